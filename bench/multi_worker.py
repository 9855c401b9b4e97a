#!/usr/bin/env python3
"""Two-worker training throughput of a CNN on Fashion-MNIST, in one session:
trainerd (`trainerd local --workers 2`), PyTorch DDP over gloo (../shared/bench/torch_cnn.py) and
TensorFlow MultiWorkerMirroredStrategy with RING (../shared/bench/tf_mwms_cnn.py). Same model,
Adam 1e-3, per-worker batch 64 (global 128), one thread per worker process, alternating runs;
prints medians and ratios. TensorFlow runs from its own virtualenv (TF_VENV).

Usage: bench/multi_worker.sh [--model cnn|big] [--runs N] [--steps N] [--no-peers]
The same session also runs trainerd without the replicas' comparison (`--replica-check-every 0`:
only the epoch's end and the run's end are compared) beside its default (every 100 steps), and
prints what the comparison costs: its share of the step time, measured both ways.
--no-peers leaves the peers out (trainerd's own figures only).
--model cnn (default) is the tutorials' CNN (mnist-cnn, 0.35 M parameters); --model big is seed 000's
CNN (mnist-cnn-big; the peers' CNN=big; 2.77 M parameters), where communication dominates.
trainerd's figure covers every step of its run, warm-up included; the peers exclude 20 warm-up
steps, so the comparison leans slightly toward them.
"""
import argparse, json, os, re, socket, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")
TF_VENV = os.environ.get("TF_VENV", os.path.expanduser("~/.cache/trainerd/venv-tf"))

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def rate(out):
    return float(re.search(r"examples_per_s=(\d+)", out).group(1))

PLUGINS = {"cnn": "libmnist_cnn.so", "big": "libmnist_cnn_big.so"}

def trainerd(steps, model, extra=()):
    """Examples/s of a 2-worker run, and the share of its training time the replica checks took."""
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        subprocess.run([os.path.join(ROOT, "target/release/trainerd"), "local", "--workers", "2",
                        "--plugin", os.path.join(ROOT, "target/release", PLUGINS[model]), "--data", DATA,
                        "--epochs", "1", "--batch-size", "64", "--threads", "1", "--steps-per-epoch", str(steps),
                        "--summary", summary, *extra], check=True, capture_output=True, text=True)
        s = json.load(open(os.path.join(d, "s.worker0.json")))
        integrity = s["integrity"]
        per_check_ms = 1000 * integrity["seconds"] / max(integrity["checks"], 1)
        return s["examples_per_second"], integrity["seconds"] / s["train_seconds"], (integrity["checks"], per_check_ms)

def peer_env(model):
    env = {**os.environ, "DATA": DATA}
    env.pop("CNN", None)
    if model == "big":
        env["CNN"] = "big"
    return env

def ddp(steps, model):
    out = subprocess.run([sys.executable, os.path.join(SHARED, "bench", "torch_cnn.py"), "ddp", "2", "1", str(steps),
                          str(free_port())], check=True, capture_output=True, text=True, env=peer_env(model)).stdout
    return rate(out)

def mwms(steps, model):
    ports = f"{free_port()},{free_port()}"
    env = {**peer_env(model), "TFPORTS": ports, "TF_USE_LEGACY_KERAS": "1", "OMP_NUM_THREADS": "1",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    py = os.path.join(TF_VENV, "bin", "python")
    script = os.path.join(SHARED, "bench", "tf_mwms_cnn.py")
    procs = [subprocess.Popen([py, script, "mw", str(i), str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    outs = [p.communicate() for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"tf_mwms_cnn.py failed:\n{e[-2000:]}")
    return rate(outs[0][0])

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=sorted(PLUGINS), default="cnn")
    ap.add_argument("--no-peers", action="store_true")
    a = ap.parse_args()
    results = {"trainerd": [], "trainerd-unchecked": []}
    if not a.no_peers:
        results.update({"pytorch-ddp": [], "tf-mwms": []})
    shares, checks, per_check = [], [], []
    for r in range(a.runs):
        if not a.no_peers:
            results["pytorch-ddp"].append(ddp(a.steps, a.model))
            results["tf-mwms"].append(mwms(a.steps, a.model))
        rate, share, (n, ms) = trainerd(a.steps + 20, a.model)
        results["trainerd"].append(rate)
        shares.append(share)
        checks.append(n)
        per_check.append(ms)
        results["trainerd-unchecked"].append(trainerd(a.steps + 20, a.model, ("--replica-check-every", "0"))[0])
        print(f"run {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()) + " examples/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    name = {"cnn": "mnist-cnn (0.35 M parameters)", "big": "mnist-cnn-big (2.77 M parameters)"}[a.model]
    line = (f"2-worker {name}, global batch 128, 1 thread per worker, median of {a.runs}: "
            f"trainerd {med['trainerd']:,.0f} examples/s")
    if not a.no_peers:
        line += (f", PyTorch DDP {med['pytorch-ddp']:,.0f} ({med['trainerd'] / med['pytorch-ddp']:.2f}x), "
                 f"TF MWMS {med['tf-mwms']:,.0f} ({med['trainerd'] / med['tf-mwms']:.2f}x)")
    print(line)
    unchecked = results["trainerd-unchecked"]
    spread = (max(unchecked) - min(unchecked)) / med["trainerd-unchecked"] * 100
    print(f"replica check (default: every 100 steps; {statistics.median(checks):.0f} checks in "
          f"{a.steps + 20} steps, the epoch's and the run's end included): {med['trainerd']:,.0f} examples/s "
          f"with it, {med['trainerd-unchecked']:,.0f} without (--replica-check-every 0): "
          f"{(med['trainerd'] / med['trainerd-unchecked'] - 1) * 100:+.1f}%, inside the runs' own spread of "
          f"{spread:.0f}%; timed directly, a check takes {statistics.median(per_check):.2f} ms and the checks "
          f"{statistics.median(shares) * 100:.3f}% of the training time (median)")

if __name__ == "__main__":
    main()
