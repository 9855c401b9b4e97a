#!/usr/bin/env python3
"""Recovery after a lost worker, in one session: trainerd beside torchrun.

torchrun (../shared/bench/torchrun_recovery.py): DDP over gloo on the tutorials' CNN; one worker is
SIGKILLed, torchrun restarts every worker, and they resume from rank 0's last torch.save (every
CKPT_EVERY steps).

trainerd: `trainerd local --workers WORLD --restart-delay 0` (a supervisor with systemd's semantics)
on mnist-cnn, the same model, data, optimizer and batch, committing every CKPT_EVERY steps. Many
kills land in one long run, at random moments, each after the previous recovery:
  - SIGKILL of a worker that is not the chief, and of the chief;
  - SIGSTOP of a worker (frozen; SIGCONT after its detection).
Measured from the moment of the signal:
  recovery  = until every worker has completed a step again (each worker's metrics log has a
              timestamp per step);
  detection = until every survivor has abandoned the step in flight (its output line);
  lost      = the furthest step any worker had completed before the signal, minus the step the
              cluster continued from;
  hang      = no recovery within HANG_S.

A worker gone for good (--gone, 3 workers, `trainerd local --no-restart 2 --replace-after R`):
seconds from the SIGKILL until the two survivors train again, and their throughput before and
while short (steps per second over the chief's metrics log). The chief gone for good
(--chief-gone, `--no-restart 0`): seconds until worker 1 is elected, until it has formed a
generation of the survivors, and until both train again.

Never pausing (--pause-kills N, --pause-freezes N): 3 workers restarted 2 s after a death, as the
systemd unit does; N kills of a worker, N of the chief and the freezes (SIGCONT after 3 s), in one
run with the default rule and in one with `--replace-after 300` (the survivors wait for the lost
worker, the rule before). Per event, the survivors' longest gap between two steps until the victim
is back, and around its return; their steps per second while short; the time back to full speed.
--pause-sharded runs the same events a third time with --shard-optimizer, and adds the steps each
event sent the cluster back to train again (none while a lost worker's buddy lives), the optimizer
state every member received in the reshards at the loss and at the return, and the longest
reshard. --pause-width W runs these events on bench/wide_mlp.py at width W (4700: 25.8 M
parameters, 206 MB of Adam state) instead of mnist-cnn, where what a reshard moves shows.

A return by state size (--state-mb 1 100 1000, --state-returns N): 3 workers of the linear plugin with
a wide table (parameters and Adam's moments of that size), worker 1 or 2 killed and restarted once the
others train again; the survivors' longest gap around its return with catch-up (the default) beside
`--catch-up-memory 0` (a pause and a state transfer, the rule before), the returner's time from its
start until it steps, and the outputs the chief kept. Given alone: nothing else is run with it.
--state-sharded shards the optimizer state in both modes; --state-clip-norm X clips the gradient
to global norm X in both (a clip whose factor is over the whole gradient).

Usage: bench/recovery.sh [--kills N] [--chief-kills N] [--freezes N] [--torchrun-trials N]
                         [--world N] [--ckpt-every N] [--gone] [--chief-gone] [--replace-after S]
                         [--pause-kills N] [--pause-freezes N] [--pause-sharded] [--pause-width W]
                         [--state-mb MB ...] [--state-returns N] [--state-sharded]
                         [--state-clip-norm X]
"""
import argparse, json, os, random, re, signal, statistics, subprocess, sys, tempfile, threading, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")
HANG_S = 60


class Cluster:
    """A `trainerd local` run whose output lines are timestamped as they arrive."""

    def __init__(self, d, world, ckpt_every, secret=False, launcher=(), extra=(), restart_delay=0, width=None,
                 wide=None):
        self.d, self.world = d, world
        self.batch = 32 if width or wide else 64
        self.lines, self.pids, self.lock = [], {}, threading.Lock()
        # mnist-cnn, or with `width` bench/wide_mlp.py (25.8 M parameters at 4700) in the python-model
        # plugin, whose Adam state is 8 bytes per parameter.
        # Or with `wide` the linear plugin with a table of that many rows (40 bytes each, 120 with
        # Adam's moments): a state of any size at little compute.
        model = (["--plugin", os.path.join(ROOT, "target/release/libpython_model.so"), "--plugin-arg",
                  f"module={os.path.join(ROOT, 'bench', 'wide_mlp.py')}", "--plugin-arg", f"width={width}"] if width
                 else ["--plugin", os.path.join(ROOT, "target/release/liblinear.so"), "--plugin-arg", f"wide={wide}"]
                 if wide else ["--plugin", os.path.join(ROOT, "target/release/libmnist_cnn.so")])
        cmd = [os.path.join(ROOT, "target/release/trainerd"), "local", "--workers", str(world),
               "--restart-delay", str(restart_delay),
               *launcher,
               *model, "--data", DATA,
               "--epochs", "1000", "--batch-size", str(self.batch), "--threads", "1", "--optimizer", "adam", "--lr", "0.001",
               "--checkpoint-dir", os.path.join(d, "ckpt"), "--checkpoint-every", str(ckpt_every),
               "--metrics-log", os.path.join(d, "m.jsonl"), *extra]
        if secret:
            # Every connection (control plane and ring) then opens with the HMAC challenge.
            path = os.path.join(d, "secret")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(os.urandom(32).hex())
            cmd += ["--secret-file", path]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for stream in (self.p.stdout, self.p.stderr):
            threading.Thread(target=self.read, args=(stream,), daemon=True).start()

    def read(self, stream):
        for line in stream:
            now = time.time()
            line = line.rstrip("\n")
            with self.lock:
                self.lines.append((now, line))
                for w, pid in re.findall(r"worker (\d+) \(pid (\d+)\)", line) + re.findall(r"worker (\d+) restarted \(pid (\d+)\)", line):
                    self.pids[int(w)] = int(pid)

    def steps(self, worker):
        """(time, global_step) of every step worker `worker` logged."""
        try:
            with open(os.path.join(self.d, f"m.worker{worker}.jsonl")) as f:
                return [(j["time"], j["global_step"]) for j in map(json.loads, filter(None, f.read().splitlines()))]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return []

    def wait_steps(self, n, timeout=120):
        """Waits until every worker has logged at least `n` steps after now."""
        since, deadline = time.time(), time.time() + timeout
        while time.time() < deadline:
            if all(sum(1 for t, _ in self.steps(w) if t > since) >= n for w in range(self.world)):
                return True
            time.sleep(0.05)
        return False

    def event(self, victim, sig):
        """Sends `sig` to worker `victim` (SIGCONT once a SIGSTOP is detected); measures the recovery."""
        before = max((s for w in range(self.world) for _, s in self.steps(w)), default=0)
        with self.lock:
            mark, pid = len(self.lines), self.pids[victim]
        t0 = time.time()
        os.kill(pid, sig)
        survivors = [w for w in range(self.world) if w != victim]
        detected, resumed, frozen = {}, None, sig == signal.SIGSTOP
        while time.time() < t0 + HANG_S:
            with self.lock:
                new = self.lines[mark:]
            for t, line in new:
                m = re.match(r"\[worker (\d+)\] trainerd: step \d+ abandoned", line)
                if m and int(m.group(1)) in survivors:
                    detected.setdefault(int(m.group(1)), t - t0)
                m = re.match(r"\[worker \d+\] trainerd: generation \d+ formed at step (\d+)", line)
                if m and resumed is None:
                    resumed = int(m.group(1))
            if frozen and len(detected) == len(survivors):
                os.kill(pid, signal.SIGCONT)
                frozen = False
            if resumed is not None:
                # A step past the one the cluster continued from belongs to the new generation.
                firsts = [min((t for t, s in self.steps(w) if t > t0 and s > resumed), default=None) for w in range(self.world)]
                if None not in firsts:
                    return {"recovery_s": max(firsts) - t0, "detection_s": max(detected.values(), default=None),
                            "steps_lost": max(0, before - resumed), "at_step": before,
                            "resumed": resumed, "epoch_end": resumed % self.steps_per_epoch() == 0,
                            "phase": self.phase(mark, t0)}
            time.sleep(0.01)
        return {"hang": True}

    def phase(self, mark, t0):
        """What the cluster was doing when the signal came: an evaluation or epoch end (its lines
        around the signal), a commit (the chief's commit lines), or a step."""
        with self.lock:
            around = [line for t, line in self.lines[max(0, mark - 40):] if t0 - 1.0 <= t <= t0 + 0.2]
        if any("evaluat" in l or re.search(r"\] Epoch \d+/", l) or "val_loss" in l for l in around):
            return "epoch end"
        if any("committed" in l or "commit " in l for l in around):
            return "commit"
        return "step"

    def steps_per_epoch(self):
        return 60000 // (self.batch * self.world)

    def epoch_end_pause(self):
        """Median seconds between an epoch's last step and the next step on worker 0 (its
        evaluation and commit): work a failure-free run does there too."""
        steps, spe = self.steps(0), self.steps_per_epoch()
        gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[1] % spe == 0 and b[1] == a[1] + 1]
        return statistics.median(gaps) if gaps else 0.0

    def stop(self):
        # RECOVERY_LOG=FILE keeps the cluster's lines (each with its arrival time) and each
        # worker's steps ("step W G": worker W ended global step G then), in time order, for a look
        # at what happened around an event.
        if os.environ.get("RECOVERY_LOG"):
            with self.lock:
                lines = list(self.lines)
            lines += [(t, f"step {w} {g}") for w in range(self.world) for t, g in self.steps(w)]
            with open(os.environ["RECOVERY_LOG"], "a") as f:
                f.writelines(f"{t:.6f} {line}\n" for t, line in sorted(lines))
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()


def trainerd(args):
    results = {"worker": [], "chief": [], "frozen": []}
    plan = ["worker"] * args.kills + ["chief"] * args.chief_kills + ["frozen"] * args.freezes
    random.Random(7).shuffle(plan)
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(d, args.world, args.ckpt_every, args.secret)
        try:
            if not c.wait_steps(30, timeout=300):
                sys.exit("trainerd did not start training")
            for i, kind in enumerate(plan):
                time.sleep(random.uniform(0.2, 1.0))
                victim = 0 if kind == "chief" else random.randrange(1, args.world)
                r = c.event(victim, signal.SIGSTOP if kind == "frozen" else signal.SIGKILL)
                results[kind].append(r)
                print(f"trainerd {i + 1}/{len(plan)}: {kind} {victim}: {r}", flush=True)
                if r.get("hang"):
                    break
                c.wait_steps(20)
            results["epoch_end_pause_s"] = c.epoch_end_pause()
        finally:
            c.stop()
    return results


def gone(args, victim=2):
    """Worker `victim` of three killed and never restarted: time until the survivors train again
    (for the chief: until one of them is elected and forms a generation), and their throughput
    before and while short."""
    survivors = [w for w in range(3) if w != victim]
    lead = survivors[0]
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(d, 3, args.ckpt_every, launcher=("--no-restart", str(victim)),
                    extra=("--replace-after", str(args.replace_after)))
        try:
            if not c.wait_steps(60, timeout=300):
                sys.exit("trainerd did not start training")
            time.sleep(10)
            with c.lock:
                mark, pid = len(c.lines), c.pids[victim]
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            formed, elected = None, None
            while time.time() < t0 + args.replace_after + HANG_S and formed is None:
                with c.lock:
                    new = c.lines[mark:]
                for t, line in new:
                    if re.match(rf"\[worker {lead}\] trainerd: worker {lead} .* coordinates from term", line):
                        elected = elected or t
                    m = re.match(rf"\[worker {lead}\] trainerd: generation \d+ formed at step (\d+): .* 2 of 3 workers", line)
                    if m:
                        formed = (int(m.group(1)), t)
                time.sleep(0.05)
            if formed is None:
                return {"hang": True}
            while not all(any(t > t0 and s > formed[0] for t, s in c.steps(w)) for w in survivors):
                time.sleep(0.05)
            back = max(min(t for t, s in c.steps(w) if t > t0 and s > formed[0]) for w in survivors)
            time.sleep(15)
            steps = c.steps(lead)
            rate = lambda a, b: sum(1 for t, _ in steps if a < t <= b) / (b - a)
            return {"continues_s": back - t0, "formed_s": formed[1] - t0,
                    "elected_s": elected - t0 if elected else None,
                    "before_steps_s": rate(t0 - 10, t0), "short_steps_s": rate(back, back + 10)}
        finally:
            c.stop()


def pause_event(c, victim, sig, cont_after=3.0):
    """One event of the never-pause measurement: `sig` to worker `victim` (a SIGSTOP is followed by
    SIGCONT `cont_after` seconds later), on a cluster restarting its workers after 2 s as the unit
    does. Measured on the survivors' per-step timestamps:
      step_s    = their median time between two steps before the event;
      lost_gap  = their longest gap between two steps from the signal until the victim is back
                  (its new process started, or SIGCONT), which is how long they waited for it
                  (a gap after an epoch's last step is left out: its evaluation and commit
                  take it in a failure-free run too, so an event inside that pause is not seen);
      return_gap = their longest gap from then until 2 s after the victim stepped again (taking
                  its slots back);
      switch_gap = their gap that ends with their first step after the generation without the
                  victim ended for its return (the step in which it takes its slots back);
      short_steps_s / full_steps_s = their steps per second while short / before;
      back_s    = from the victim's return until it has stepped again (full speed)."""
    survivors = [w for w in range(c.world) if w != victim]
    with c.lock:
        mark, pid = len(c.lines), c.pids[victim]
    t0 = time.time()
    os.kill(pid, sig)
    back = None
    if sig == signal.SIGSTOP:
        time.sleep(cont_after)
        os.kill(pid, signal.SIGCONT)
        back = time.time()
    deadline = t0 + HANG_S
    while back is None and time.time() < deadline:
        with c.lock:
            back = next((t for t, line in c.lines[mark:] if re.search(rf"worker {victim} restarted \(pid", line)), None)
        time.sleep(0.02)
    stepped = None
    while back is not None and stepped is None and time.time() < deadline:
        stepped = min((t for t, _ in c.steps(victim) if t > back), default=None)
        time.sleep(0.05)
    if stepped is None:
        return {"hang": True}
    time.sleep(2.5)
    with c.lock:
        # With the optimizer state sharded, a lost worker sends every member back to the last
        # commit: the steps each says it trains again.
        again = [int(m.group(1)) for _, line in c.lines[mark:]
                 for m in [re.search(r"\((\d+) step\(s\) to train again", line)] if m]
        # And what each reshard moved: the MB every member received, and its seconds, at the loss
        # (before the victim is back) and at its return.
        moves = [(t, float(m.group(1)), float(m.group(2))) for t, line in c.lines[mark:]
                 for m in [re.search(r"it received ([\d.]+) MB .*\(([\d.]+)s\)$", line)] if m]
    spe = c.steps_per_epoch()
    def gaps(w, a, b):
        # Not the pause after an epoch's last step (its evaluation and commit): a failure-free
        # run takes it too, and on 2 of 3 workers it is longer by the evaluation's share.
        steps = c.steps(w)
        return [y - x for (x, s), (y, _) in zip(steps, steps[1:]) if y > a and x < b and s % spe != 0]
    # The step in which the victim takes its slots back: the first after the generation without it
    # ends for its return (after a catch-up, or for a pause and a state transfer).
    with c.lock:
        ended = next((t for t, line in c.lines[mark:]
                      if t >= back and re.search(rf"ends after step \d+: worker {victim} \(.*came back", line)), None)
    firsts = [next(((x, y) for (x, _), (y, _) in zip(c.steps(w), c.steps(w)[1:]) if y > ended), None)
              for w in survivors] if ended is not None else []
    switch_gap = max((y - x for x, y in filter(None, firsts)), default=float("nan"))
    before = [g for w in survivors for g in gaps(w, t0 - 5, t0)][:-1]
    lost_gap = max(max(gaps(w, t0, back), default=0.0) for w in survivors)
    return_gap = max(max(gaps(w, back, stepped + 2), default=0.0) for w in survivors)
    rate = lambda a, b: sum(1 for t, _ in c.steps(survivors[0]) if a < t <= b) / (b - a)
    short_from = t0 + lost_gap
    return {"step_s": statistics.median(before) if before else float("nan"), "lost_gap": lost_gap,
            "return_gap": return_gap, "switch_gap": switch_gap, "full_steps_s": rate(t0 - 5, t0),
            "short_steps_s": rate(short_from, back) if back - short_from > 0.5 else float("nan"),
            "back_s": stepped - back, "trained_again": max(again, default=0),
            "moved_mb_lost": sum(mb for t, mb, _ in moves if t < back),
            "moved_mb_back": sum(mb for t, mb, _ in moves if t >= back),
            "reshard_s": max((s for _, _, s in moves), default=0.0)}


def never_pause(args, extra):
    """Kills of a worker and of the chief (restarted 2 s later) and freezes of a worker, on 3
    workers, with the flags `extra` (none: the rule of the day; `--replace-after 300`: the survivors
    wait for the lost worker, as before the never-pause work)."""
    plan = ["worker"] * args.pause_kills + ["chief"] * args.pause_kills + ["frozen"] * args.pause_freezes
    random.Random(11).shuffle(plan)
    results = {"worker": [], "chief": [], "frozen": []}
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(d, 3, args.ckpt_every, extra=extra, restart_delay=2, width=args.pause_width)
        try:
            if not c.wait_steps(30, timeout=300):
                sys.exit("trainerd did not start training")
            for i, kind in enumerate(plan):
                time.sleep(random.uniform(0.5, 1.5))
                victim = 0 if kind == "chief" else random.randrange(1, 3)
                r = pause_event(c, victim, signal.SIGSTOP if kind == "frozen" else signal.SIGKILL)
                results[kind].append(r)
                print(f"never-pause ({' '.join(extra) or 'default'}) {i + 1}/{len(plan)}: {kind} {victim} at "
                      f"{time.time():.3f}: {r}", flush=True)
                if r.get("hang"):
                    break
                c.wait_steps(20)
        finally:
            c.stop()
    return results


def never_pause_table(now, before, peer, sharded=None, width=None):
    ok = lambda rs: [r for r in rs if not r.get("hang")]
    model = f"bench/wide_mlp.py at width {width}, batch 32" if width else "mnist-cnn"
    print(f"\nThe survivors' longest gap between two steps, per event (3 workers, {model}, restarted after 2 s as "
          "the unit does; a frozen worker gets SIGCONT after 3 s; medians, max in brackets):")
    print("| event | goal | trainerd | trainerd, the rule before (`--replace-after 300`) | torchrun (a worker killed) |"
          + (" trainerd `--shard-optimizer` |" if sharded else ""))
    print("|---|---|---|---|---|" + ("---|" if sharded else ""))
    count = lambda rs, k: f"{median(rs, k):g} ({max((r[k] for r in rs), default=float('nan')):g})"
    sh = lambda kind, k, f=None: f" {(f or fmt)(ok(sharded[kind]), k)} |" if sharded else ""
    goals = {"worker": "<= 0.15 s", "chief": "<= 0.15 s", "frozen": "heartbeat deadline + 0.1 s = 1.6 s"}
    names = {"worker": "a worker SIGKILLed", "chief": "the chief SIGKILLed", "frozen": "a worker frozen"}
    fmt = lambda rs, k: f"{median(rs, k):.2f} s ({max((r[k] for r in rs), default=float('nan')):.2f} s)"
    for kind in ("worker", "chief", "frozen"):
        n, b = ok(now[kind]), ok(before[kind])
        torch = f"{median(peer, 'recovery_s'):.2f} s" if kind == "worker" and peer else "-"
        print(f"| {names[kind]}: until it is back | {goals[kind]} | {fmt(n, 'lost_gap')} | {fmt(b, 'lost_gap')} | {torch} |"
              + sh(kind, "lost_gap"))
        print(f"| {names[kind]}: its return | one step + 50 ms ({median(n, 'step_s') * 1e3 + 50:.0f} ms) | "
              f"{fmt(n, 'return_gap')} | {fmt(b, 'return_gap')} | - |" + sh(kind, "return_gap"))
        if sharded:
            print(f"| {names[kind]}: steps trained again | 0 | {count(n, 'trained_again')} | "
                  f"{count(b, 'trained_again')} | - |" + sh(kind, "trained_again", count))
            mb = lambda rs, k: f"{median(rs, k):.1f} MB ({max((r[k] for r in rs), default=float('nan')):.1f} MB)"
            print(f"| {names[kind]}: optimizer state received by every member, at the loss / at the return | - | - "
                  f"| - | - | {mb(ok(sharded[kind]), 'moved_mb_lost')} / {mb(ok(sharded[kind]), 'moved_mb_back')} |")
            print(f"| {names[kind]}: a member's longest reshard | - | - | - | - |" + sh(kind, "reshard_s"))
    allr = [r for k in ("worker", "chief", "frozen") for r in ok(now[k])]
    print(f"| steps/s before / while short (2 of 3) | - | {median(allr, 'full_steps_s'):.1f} / "
          f"{median(allr, 'short_steps_s'):.1f} | - | - |" + (" - |" if sharded else ""))
    print(f"| back to full speed (the victim's return until it steps) | - | {median(allr, 'back_s'):.2f} s | "
          f"{median([r for k in now for r in ok(before[k])], 'back_s'):.2f} s | - |" + (" - |" if sharded else ""))
    runs = [now, before] + ([sharded] if sharded else [])
    hangs = sum(1 for run in runs for k in run for r in run[k] if r.get("hang"))
    events = sum(len(run[k]) for run in runs for k in run)
    print(f"| hangs | 0 | {hangs} in {events} events (every column) | | |" + (" |" if sharded else ""))


def returns_by_size(args):
    """A return's cost by state size (--state-mb): per size, 3 workers of the linear plugin with a
    wide table sized so that parameters and Adam's two moments make that many MB, `--state-returns`
    kills of worker 1 or 2, each restarted once the two others train again; once with catch-up
    (the default) and once with `--catch-up-memory 0` (a return pauses the survivors for a state
    transfer, as before). Per event, from pause_event: the survivors' longest gap around the return
    (on a machine shared by the 3 workers, the catch-up's own work slows their steps meanwhile),
    the step in which the returner takes its slots back, and their median step before; the returner's time from its start until it stepped; and from
    the lines, whether it caught up (or fell back, and why) and the outputs the chief kept."""
    results = {}
    # With --state-sharded, the optimizer state is sharded over the workers in both modes.
    shard = ("--shard-optimizer",) if args.state_sharded else ()
    # With --state-clip-norm, the gradient is clipped to that global norm in both modes.
    shard += ("--clip-norm", str(args.state_clip_norm)) if args.state_clip_norm else ()
    for mb in args.state_mb:
        rows = max(1, int(mb * 1e6 / 120))
        # The survivors must train again before the victim is back (re-forming hashes the state).
        delay = 2 + 4 * mb / 1000
        for mode, extra in (("catch-up", shard), ("pause", shard + ("--catch-up-memory", "0"))):
            rs = []
            with tempfile.TemporaryDirectory() as d:
                c = Cluster(d, 3, 10 ** 9, extra=extra, restart_delay=delay, wide=rows)
                try:
                    if not c.wait_steps(5, timeout=600):
                        sys.exit(f"trainerd did not start training at {mb} MB")
                    for i in range(args.state_returns):
                        with c.lock:
                            mark = len(c.lines)
                        r = pause_event(c, 1 + i % 2, signal.SIGKILL)
                        with c.lock:
                            new = [line for _, line in c.lines[mark:]]
                        kept = [m.group(1) for l in new for m in [re.search(r"at most ([\d.]+ [KMG]?B) of outputs kept", l)] if m]
                        fell = [l.split("catch-up stopped: ", 1)[1] for l in new if "catch-up stopped: " in l]
                        r.update(caught=any("trainerd: caught up in " in l for l in new), kept=kept[-1] if kept else "-",
                                 fell_back=fell[:1])
                        rs.append(r)
                        print(f"state {mb} MB ({mode}) {i + 1}/{args.state_returns}: {r}", flush=True)
                        if r.get("hang"):
                            break
                        c.wait_steps(3, timeout=300)
                finally:
                    c.stop()
            results[(mb, mode)] = rs
    print(f"\nA return by state size (3 workers, the linear plugin with a wide table, Adam"
          f"{' sharded over the workers (--shard-optimizer)' if args.state_sharded else ''}"
          f"{f', --clip-norm {args.state_clip_norm}' if args.state_clip_norm else ''}, batch 32, 1 thread each; "
          f"{args.state_returns} returns per row, restarted once the others train; medians, max in brackets):")
    print("| state | step | goal: one step + 50 ms | survivors' longest gap: catch-up | survivors' longest gap: "
          "a pause (`--catch-up-memory 0`) | the switch's step: catch-up / pause | returner: start to stepping, "
          "catch-up / pause | caught up | outputs kept |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = lambda rs: [r for r in rs if not r.get("hang")]
    fmt = lambda rs, k: f"{median(rs, k):.2f} s ({max((r[k] for r in rs), default=float('nan')):.2f} s)"
    for mb in args.state_mb:
        cu, pa = ok(results[(mb, "catch-up")]), ok(results[(mb, "pause")])
        step = median(cu + pa, "step_s")
        caught = f"{sum(1 for r in cu if r['caught'])} of {len(results[(mb, 'catch-up')])}"
        fell = sorted({f for r in cu for f in r["fell_back"]})
        print(f"| {mb:g} MB | {step:.3f} s | {step + 0.05:.3f} s | {fmt(cu, 'return_gap')} | {fmt(pa, 'return_gap')} | "
              f"{median(cu, 'switch_gap'):.2f} s / {median(pa, 'switch_gap'):.2f} s | "
              f"{median(cu, 'back_s'):.2f} s / {median(pa, 'back_s'):.2f} s | {caught}{' (' + '; '.join(fell) + ')' if fell else ''} "
              f"| {', '.join(r['kept'] for r in cu)} |")


def percentile(rs, key, q):
    xs = sorted(r[key] for r in rs if r.get(key) is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def torchrun(args):
    out = subprocess.run([sys.executable, os.path.join(SHARED, "bench", "torchrun_recovery.py"), str(args.torchrun_trials),
                          str(args.world), str(args.ckpt_every)], capture_output=True, text=True,
                         env={**os.environ, "DATA": DATA}).stdout
    print(out, end="", flush=True)
    trials = [eval(m) for m in re.findall(r"trial \d+: (\{.*\})", out)]
    return [t for t in trials if "error" not in t]


def median(rs, key):
    xs = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs of a worker that is not the chief")
    p.add_argument("--chief-kills", type=int, default=20)
    p.add_argument("--freezes", type=int, default=5, help="SIGSTOPs of a worker (SIGCONT once detected)")
    p.add_argument("--torchrun-trials", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--secret", action="store_true", help="authenticate every connection with a cluster secret")
    p.add_argument("--gone", action="store_true", help="also measure a worker of three gone for good")
    p.add_argument("--chief-gone", action="store_true", help="also measure the chief of three gone for good")
    p.add_argument("--replace-after", type=float, default=5.0, help="--replace-after for --gone (seconds)")
    p.add_argument("--pause-kills", type=int, default=0,
                   help="never-pause table: kills of a worker, and of the chief, each restarted after 2 s")
    p.add_argument("--pause-freezes", type=int, default=0, help="never-pause table: freezes of a worker")
    p.add_argument("--pause-width", type=int,
                   help="never-pause table: bench/wide_mlp.py at this width (4700: 25.8 M parameters) instead of mnist-cnn")
    p.add_argument("--state-mb", type=float, nargs="*", default=[],
                   help="a return's cost at these state sizes (MB of parameters and Adam state), with catch-up and "
                        "with --catch-up-memory 0, e.g. --state-mb 1 100 1000")
    p.add_argument("--state-returns", type=int, default=3, help="returns per state size and mode")
    p.add_argument("--state-sharded", action="store_true",
                   help="--state-mb's table with the optimizer state sharded (--shard-optimizer) in both modes")
    p.add_argument("--state-clip-norm", type=float,
                   help="--state-mb's table with the gradient clipped to this global norm (--clip-norm) in both modes")
    p.add_argument("--pause-sharded", action="store_true",
                   help="never-pause table: the same events with --shard-optimizer, beside the unsharded ones")
    args = p.parse_args()
    if args.state_mb:
        # A table of its own: the other measurements are not run with it.
        returns_by_size(args)
        return
    sharded = None
    if args.pause_kills + args.pause_freezes > 0:
        now = never_pause(args, ())
        before = never_pause(args, ("--replace-after", "300"))
        sharded = never_pause(args, ("--shard-optimizer",)) if args.pause_sharded else None
    ours = trainerd(args) if args.kills + args.chief_kills + args.freezes > 0 else {"worker": [], "chief": [], "frozen": []}
    lost_for_good = gone(args) if args.gone else None
    chief_for_good = gone(args, victim=0) if args.chief_gone else None
    peer = torchrun(args) if args.torchrun_trials > 0 else []
    if args.pause_kills + args.pause_freezes > 0:
        never_pause_table(now, before, peer, sharded, args.pause_width)
    ok = lambda rs: [r for r in rs if not r.get("hang")]
    w, c, f = ok(ours["worker"]), ok(ours["chief"]), ok(ours["frozen"])
    hangs = lambda rs: f"{sum(1 for r in rs if r.get('hang'))} in {len(rs)}"
    print()
    print(f"Recovery after one lost worker: {args.world} workers, mnist-cnn, a commit every {args.ckpt_every} steps, "
          f"restart delay 0{', every connection authenticated' if args.secret else ''} (medians)")
    print("| | trainerd: a worker killed | trainerd: the chief killed | trainerd: a worker frozen | torchrun: a worker killed |")
    print("|---|---|---|---|---|")
    print(f"| recovery (signal until every worker steps again) | {median(w, 'recovery_s'):.2f} s | "
          f"{median(c, 'recovery_s'):.2f} s | {median(f, 'recovery_s'):.2f} s | {median(peer, 'recovery_s'):.2f} s |")
    print(f"| steps lost per failure | {median(w, 'steps_lost'):g} | {median(c, 'steps_lost'):g} | "
          f"{median(f, 'steps_lost'):g} | {median(peer, 'steps_lost'):g} |")
    print(f"| detection (signal until every survivor abandoned the step) | {median(w, 'detection_s') * 1e3:.0f} ms | "
          f"{median(c, 'detection_s') * 1e3:.0f} ms | {median(f, 'detection_s'):.2f} s | - |")
    print(f"| hangs | {hangs(ours['worker'])} | {hangs(ours['chief'])} | {hangs(ours['frozen'])} | "
          f"{sum(1 for t in peer if t.get('hang'))} in {len(peer)} |")
    print(f"| recovery p90 / max | {percentile(w, 'recovery_s', 0.9):.2f} / {percentile(w, 'recovery_s', 1.0):.2f} s | "
          f"{percentile(c, 'recovery_s', 0.9):.2f} / {percentile(c, 'recovery_s', 1.0):.2f} s | "
          f"{percentile(f, 'recovery_s', 0.9):.2f} / {percentile(f, 'recovery_s', 1.0):.2f} s | "
          f"{percentile(peer, 'recovery_s', 0.9):.2f} / {percentile(peer, 'recovery_s', 1.0):.2f} s |")
    # A kill whose cluster continues from an epoch's last step waits for that epoch's evaluation
    # (and commit), which a failure-free run spends there too: shown apart from the others.
    mid = lambda rs: [r for r in rs if not r.get("epoch_end")]
    end = lambda rs: [r for r in rs if r.get("epoch_end")]
    print(f"| kills within an epoch: p90 / max | {percentile(mid(w), 'recovery_s', 0.9):.2f} / "
          f"{percentile(mid(w), 'recovery_s', 1.0):.2f} s | {percentile(mid(c), 'recovery_s', 0.9):.2f} / "
          f"{percentile(mid(c), 'recovery_s', 1.0):.2f} s | - | - |")
    print(f"| kills at an epoch's end (the failure-free pause there: {ours.get('epoch_end_pause_s', 0.0):.2f} s): count, "
          f"median | {len(end(w))}, {median(end(w), 'recovery_s'):.2f} s | {len(end(c))}, {median(end(c), 'recovery_s'):.2f} s "
          f"| - | - |")
    slow = sorted((r for r in w if r.get("recovery_s") is not None), key=lambda r: -r["recovery_s"])[:5]
    if slow:
        print("\nSlowest worker kills (recovery, detection, what the cluster was doing):")
        for r in slow:
            at = "an epoch's last step" if r.get("epoch_end") else r["phase"]
            print(f"  {r['recovery_s']:.2f} s, detection {r['detection_s'] or float('nan'):.2f} s, at step {r['at_step']}: {at}")
    if lost_for_good is not None:
        g = lost_for_good
        print(f"\nA worker of three gone for good (--replace-after {args.replace_after:g} s): ", end="")
        if g.get("hang"):
            print("no generation formed without it")
        else:
            print(f"training continues {g['continues_s']:.2f} s after the kill; {g['before_steps_s']:.1f} steps/s before, "
                  f"{g['short_steps_s']:.1f} steps/s on 2 of 3 ({g['short_steps_s'] / g['before_steps_s']:.2f}x)")
    if chief_for_good is not None:
        g = chief_for_good
        print(f"\nThe chief of three gone for good (--replace-after {args.replace_after:g} s): ", end="")
        if g.get("hang"):
            print("no coordinator was elected")
        else:
            print(f"worker 1 elected {g['elected_s']:.2f} s after the kill, a generation formed at {g['formed_s']:.2f} s "
                  f"({g['formed_s'] - args.replace_after:.2f} s beyond --replace-after), training continues at "
                  f"{g['continues_s']:.2f} s; {g['before_steps_s']:.1f} steps/s before, {g['short_steps_s']:.1f} steps/s "
                  f"on 2 of 3 ({g['short_steps_s'] / g['before_steps_s']:.2f}x); no peer figure (the shared torchrun bench "
                  f"runs one agent on one host, which restarts every rank from rank 0's last save)")


if __name__ == "__main__":
    main()
