#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU, PyTorch 2.11.0+cu130 in a python3, no network
# and no Rust toolchain (the machine this project borrows; see docs/gpu.md).
#
#   scripts/gpu-check.sh        HERE (network, Rust): builds trainerd and its plugins against that
#                               machine's PyTorch (tch 0.26 expects 2.13, so torch-sys is patched by
#                               scripts/patch-torch-sys.sh), strips them, and packs them with
#                               Fashion-MNIST into .gpu/ (git-ignored, under 64 MiB). Then run the
#                               second half there with .gpu/ carried along.
#   scripts/gpu-check.sh run    THERE: runs every check against the machine's own libtorch and prints
#                               the results (also to $OUT/gpu-check.md when OUT is set). Exit status 1
#                               if a check failed.
#
# Checks: mnist-cnn on cuda for 1 epoch reaches test accuracy >= 0.85; the same run twice gives the
# same params_sha256; 2 workers sharing the GPU end identical; a SIGKILL then a resume from the
# last commit is bitwise equal to the uninterrupted run; a 2-worker run whose worker 1 is killed and
# restarted (it rejoins) is bitwise equal to the uninterrupted one; examples/s beside PyTorch eager
# (bench/gpu_eager.py) at batch 64 and 512; over NCCL (2 ranks on the GPU): the accuracy bar, the
# same bits as the ring's, a rank or the chief killed, a rank frozen; replicas in one daemon
# (--devices) bitwise the ranks they stand for; all-reduce and DDP tables.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${GPU_CHECK_BUNDLE:-.gpu}
GPU_TORCH=2.11.0
# For a dry run of the checks' logic on a machine without a GPU: GPU_CHECK_DEVICE=cpu.
DEVICE=${GPU_CHECK_DEVICE:-cuda}

prepare() {
    source scripts/env.sh
    local venv="$TRAINERD_CACHE/venv-torch-$GPU_TORCH" sys="$TRAINERD_CACHE/torch-sys-0.26.0-for-torch-$GPU_TORCH"
    if [ ! -e "$venv/.trainerd-complete" ]; then
        echo "gpu-check: installing PyTorch $GPU_TORCH (the GPU machine's; CUDA 13.0 wheel) into $venv"
        rm -rf "$venv" && python3 -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check "torch==$GPU_TORCH"
        touch "$venv/.trainerd-complete"
    fi
    if [ ! -e "$sys/.trainerd-complete" ]; then
        cargo fetch -q
        scripts/patch-torch-sys.sh "$venv" "$sys"
        touch "$sys/.trainerd-complete"
    fi
    # The patched torch-sys rewrites Cargo.lock's entry for it: put the lock back afterwards.
    local lock
    lock=$(mktemp)
    cp Cargo.lock "$lock"
    trap 'cp "$lock" Cargo.lock; rm -f "$lock"' RETURN
    echo "gpu-check: building against PyTorch $GPU_TORCH into target/gpu"
    PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1 \
        CARGO_TARGET_DIR=target/gpu cargo build --release -p trainerd -p mnist-cnn -p mnist-cnn-big -p linear -p torchscript \
        --config "patch.crates-io.torch-sys.path=\"$sys\""
    # The all-reduce benchmark (NCCL and the host-staged ring on the GPU's buffers).
    local bench
    bench=$(PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1 \
        CARGO_TARGET_DIR=target/gpu cargo bench --no-run -p trainerd --bench allreduce --message-format=json \
        --config "patch.crates-io.torch-sys.path=\"$sys\"" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "allreduce" and m.get("executable"):
        print(m["executable"])')
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin" "$BUNDLE/data"
    for f in trainerd libmnist_cnn.so libmnist_cnn_big.so liblinear.so libtorchscript.so; do strip -o "$BUNDLE/bin/$f" "target/gpu/release/$f"; done
    strip -o "$BUNDLE/bin/allreduce" "$bench"
    scripts/setup.sh --no-build >/dev/null
    cp /usr/share/datasets/fashion-mnist/*.gz "$BUNDLE/data/"
    echo "gpu-check: $BUNDLE is ready ($(du -sh "$BUNDLE" | cut -f1)); on the GPU machine, with $BUNDLE carried: scripts/gpu-check.sh run"
}

# The value of KEY in a summary JSON.
field() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
# examples/s of the last epoch line of a run's output.
last_rate() { grep -E "^[0-9]+/[0-9]+ - .* examples/s$" "$1" | tail -1 | sed -E 's/.* - ([0-9,]+) examples\/s$/\1/; s/,//g'; }

run_checks() {
    PY=${PYTHON:-python3}
    "$PY" -c "import torch" 2>/dev/null || PY=/opt/torch/.venv/bin/python3
    local lib
    lib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local T="$BUNDLE/bin/trainerd" CNN="$BUNDLE/bin/libmnist_cnn.so" D="$BUNDLE/data"
    local R="${OUT:-$BUNDLE/results}"
    local W="$R/gpu-check" report="$R/gpu-check.md" failed=0
    rm -rf "$W" && mkdir -p "$W"
    : > "$report"
    say() { echo "$*" | tee -a "$report"; }
    check() { # NAME CONDITION-TEXT OK?
        if [ "$3" = 1 ]; then say "| $1 | $2 | pass |"; else say "| $1 | $2 | FAIL |"; failed=1; fi
    }
    say "## trainerd GPU checks ($(date -u +%Y-%m-%dT%H:%MZ))"
    say '```'
    "$T" --version | tee -a "$report"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$report" || true
    say '```'
    local cnn=(--plugin "$CNN" --data "$D" --threads 1 --seed 7)
    # GPU_CHECK_ONLY=throughput: the examples/s table alone; =nccl: the NCCL checks alone (the
    # ring's figures beside them are then taken too); =devices: the replica checks alone;
    # =precision: bf16 and fp16 beside PyTorch autocast; =torchscript: a PyTorch model through the
    # torchscript plugin; =bench:
    # the all-reduce and DDP tables alone; =untried: the precision and torchscript checks (the
    # ones that had not run on a GPU yet, about two minutes).
    # (The whole set runs past one 600 s command of the device machine: run it in two parts,
    # GPU_CHECK_ONLY=first then =second.)
    case "${GPU_CHECK_ONLY:-all}" in
        throughput) throughput_checks ;;
        nccl) correctness_checks; nccl_checks ;;
        devices) devices_checks ;;
        precision) precision_checks ;;
        torchscript) torchscript_checks ;;
        bench) nccl_bench ;;
        train) training_bench ;;
        first) correctness_checks; nccl_checks; devices_checks ;;
        second) precision_checks; torchscript_checks; throughput_checks; nccl_bench ;;
        untried) precision_checks; torchscript_checks ;;
        *) correctness_checks; nccl_checks; devices_checks; precision_checks; torchscript_checks; throughput_checks; nccl_bench ;;
    esac
    say ""
    say "Logs and summaries: $W"
    return $failed
}

correctness_checks() {
    echo "gpu-check: 1 worker, 1 epoch, twice" >&2
    "$T" run "${cnn[@]}" --device "$DEVICE" --epochs 1 --summary "$W/a.json" > "$W/a.log" 2>&1
    "$T" run "${cnn[@]}" --device "$DEVICE" --epochs 1 --summary "$W/b.json" > "$W/b.log" 2>&1
    local acc sha_a sha_b
    acc=$(field "$W/a.json" test_accuracy); sha_a=$(field "$W/a.json" params_sha256); sha_b=$(field "$W/b.json" params_sha256)
    say ""
    say "| check | figure | result |"
    say "|---|---|---|"
    check "device" "$(field "$W/a.json" device): $(grep -m1 '^trainerd: libtorch' "$W/a.log" | cut -c11-)" \
        "$([ "$(field "$W/a.json" device)" = "${DEVICE/cuda/cuda:0}" ] && echo 1 || echo 0)"
    check "1 epoch on cuda: test accuracy >= 0.85" "$acc" "$("$PY" -c "print(int($acc >= 0.85))")"
    check "same run twice: same params_sha256" "${sha_a:0:16} / ${sha_b:0:16}" "$([ "$sha_a" = "$sha_b" ] && echo 1 || echo 0)"

    echo "gpu-check: 2 workers sharing the GPU" >&2
    "$T" local --workers 2 "${cnn[@]}" --device auto --batch-size 32 --epochs 1 --summary "$W/two.json" > "$W/two.log" 2>&1
    local s0 s1
    s0=$(field "$W/two.worker0.json" params_sha256); s1=$(field "$W/two.worker1.json" params_sha256)
    check "2 workers sharing the GPU: identical params_sha256" "${s0:0:16} / ${s1:0:16} ($(field "$W/two.worker1.json" device))" \
        "$([ "$s0" = "$s1" ] && echo 1 || echo 0)"

    echo "gpu-check: SIGKILL mid-epoch, then resume from the last commit" >&2
    local k=("${cnn[@]}" --device "$DEVICE" --epochs 1 --checkpoint-dir "$W/ck" --checkpoint-every 100 --summary "$W/k.json")
    "$T" run "${k[@]}" > "$W/k1.log" 2>&1 &
    local pid=$!
    until grep -q "^checkpoint 4 committed" "$W/k1.log" 2>/dev/null; do sleep 0.05; kill -0 $pid 2>/dev/null || break; done
    kill -9 $pid 2>/dev/null || true
    wait $pid 2>/dev/null || true
    "$T" run "${k[@]}" > "$W/k2.log" 2>&1
    local sha_k
    sha_k=$(field "$W/k.json" params_sha256)
    check "SIGKILL, then resume: bitwise equal to the uninterrupted run" \
        "$(grep -m1 'resumed from checkpoint' "$W/k2.log" | cut -c11-60)...; ${sha_k:0:16}" "$([ "$sha_k" = "$sha_a" ] && echo 1 || echo 0)"

    echo "gpu-check: 2 workers, worker 1 killed and restarted (it rejoins)" >&2
    "$T" local --workers 2 --restart-delay 0 "${cnn[@]}" --device auto --batch-size 32 --epochs 1 --summary "$W/ft.json" \
        > "$W/ft.log" 2>&1 &
    local lpid=$! wpid=""
    until [ -n "$wpid" ]; do sleep 0.1; wpid=$(grep -o "worker 1 (pid [0-9]*)" "$W/ft.log" | grep -o "[0-9]*)" | tr -d ')' || true); done
    until grep -q "^\[worker 0\] 372/937" "$W/ft.log" 2>/dev/null; do sleep 0.05; done
    kill -9 "$wpid"
    wait $lpid || true
    local f0 f1 rejoined
    f0=$(field "$W/ft.worker0.json" params_sha256); f1=$(field "$W/ft.worker1.json" params_sha256)
    rejoined=$(grep -m1 "rejoined at step" "$W/ft.log" | sed 's/^trainerd local: //' || true)
    check "2 workers, worker 1 killed and rejoined: bitwise equal, 0 steps lost" "${rejoined:-no rejoin line}" \
        "$([ "$f0" = "$s0" ] && [ "$f1" = "$s0" ] && echo "$rejoined" | grep -q " 0 step(s) lost" && echo 1 || echo 0)"

}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Worker RANK of a 2-worker cluster on ports $P0 $P1, over NCCL on the one GPU (its own
# NCCL_HOSTID, NCCL's sockets on loopback), writing $W/NAME.workerRANK.{log,json}. Run it in the
# background only: it becomes the trainerd process (so $! is the worker's pid).
nccl_worker() {
    local r=$1 name=$2
    shift 2
    TF_CONFIG="{\"cluster\":{\"worker\":[\"127.0.0.1:$P0\",\"127.0.0.1:$P1\"]},\"task\":{\"type\":\"worker\",\"index\":$r}}" \
        NCCL_HOSTID="gpu-check-$r" NCCL_SOCKET_IFNAME=lo \
        exec "$T" run ${PLACE:---device $DEVICE} --collective nccl --summary "$W/$name.worker$r.json" "$@" >> "$W/$name.worker$r.log" 2>&1
}

# Both workers of NAME, to the end.
nccl_pair() {
    local name=$1
    shift
    P0=$(free_port); P1=$(free_port)
    nccl_worker 0 "$name" "$@" &
    local a=$!
    nccl_worker 1 "$name" "$@" &
    local b=$!
    wait $a; wait $b
}

# 2 ranks over NCCL on one GPU: the accuracy bar, identical ranks, the same bits twice and as the
# ring's, and a rank SIGKILLed mid-epoch and restarted.
nccl_checks() {
    local two=(--plugin "$CNN" --data "$D" --threads 1 --seed 7 --batch-size 32 --epochs 1)
    echo "gpu-check: 2 ranks over NCCL on one GPU (NCCL_HOSTID), twice" >&2
    nccl_pair n1 "${two[@]}"
    nccl_pair n2 "${two[@]}"
    local a0 a1 b0 acc ring
    a0=$(field "$W/n1.worker0.json" params_sha256); a1=$(field "$W/n1.worker1.json" params_sha256)
    b0=$(field "$W/n2.worker0.json" params_sha256); acc=$(field "$W/n1.worker0.json" test_accuracy)
    say ""
    say "| NCCL check (2 ranks on one GPU, each with its own NCCL_HOSTID) | figure | result |"
    say "|---|---|---|"
    check "backend" "$(grep -m1 '^trainerd: gradients over' "$W/n1.worker0.log" | cut -c11-)" \
        "$(grep -q '^trainerd: gradients over the NCCL' "$W/n1.worker0.log" && echo 1 || echo 0)"
    check "1 epoch: test accuracy >= 0.85" "$acc" "$("$PY" -c "print(int($acc >= 0.85))")"
    check "both ranks: identical params_sha256" "${a0:0:16} / ${a1:0:16}" "$([ "$a0" = "$a1" ] && echo 1 || echo 0)"
    check "same run twice: same params_sha256" "${a0:0:16} / ${b0:0:16}" "$([ "$a0" = "$b0" ] && echo 1 || echo 0)"
    ring=$(field "$W/two.worker0.json" params_sha256 2>/dev/null || echo none)
    check "bit for bit the host-staged ring's 2-worker run" "${a0:0:16} / ${ring:0:16}" "$([ "$a0" = "$ring" ] && echo 1 || echo 0)"

    echo "gpu-check: NCCL, rank 1 SIGKILLed mid-epoch and restarted at once" >&2
    nccl_disturbed nk 1 kill "${two[@]}"
    local ring_rec created
    ring_rec=$(recovery "$W/ft.worker0.json" 2>/dev/null || echo "not run")
    created=$(grep -h "NCCL communicator ready" "$W/nk.worker0.log" | tail -1 | sed -E 's/.*ready ([0-9.]+s).*/\1/')
    survived nk 0 "rank 1 killed and restarted: 0 steps lost, bitwise equal to the uninterrupted NCCL run" ""
    say "| recovery (survivor: failure to its first step again) | NCCL $(recovery "$W/nk.worker0.json" || echo "?") (its new communicator ready in ${created:-?}) / ring ${ring_rec} | - |"

    echo "gpu-check: NCCL, the chief SIGKILLed mid-epoch and restarted at once" >&2
    nccl_disturbed nc 0 kill "${two[@]}"
    survived nc 1 "the chief killed and restarted: 0 steps lost, bitwise equal" \
        "worker 1 training again after $(recovery "$W/nc.worker1.json" || echo "?"); "

    echo "gpu-check: NCCL, rank 1 frozen for 3 s (heartbeat deadline 1.5 s), then woken" >&2
    nccl_disturbed nf 1 freeze "${two[@]}"
    survived nf 0 "rank 1 frozen past the heartbeat deadline, woken: it rejoins, 0 steps lost, bitwise equal" \
        "$(grep -m1 "abandoned" "$W/nf.worker0.log" | cut -c11-90 || true)...; "
}

# Several replicas in one daemon (--devices): two replicas sharing the GPU are bitwise the 2-rank
# NCCL run; two daemons of two replicas each over NCCL are bitwise one daemon of four.
devices_checks() {
    local two=(--plugin "$CNN" --data "$D" --threads 1 --seed 7 --batch-size 32 --epochs 1 --steps-per-epoch 300)
    echo "gpu-check: 2 ranks over NCCL, one daemon of 2 and of 4 replicas (--devices), 2 daemons of 2 over NCCL" >&2
    nccl_pair d1 "${two[@]}"
    # Two replicas on the one GPU by default; on a machine with two, GPU_CHECK_REPLICAS=cuda:0,cuda:1.
    local pair=${GPU_CHECK_REPLICAS:-$DEVICE,$DEVICE}
    "$T" run --devices "$pair" --summary "$W/r2.json" "${two[@]}" > "$W/r2.log" 2>&1 || true
    "$T" run --devices "$pair,$pair" --summary "$W/r4.json" "${two[@]}" > "$W/r4.log" 2>&1 || true
    PLACE="--devices $pair" nccl_pair n4 "${two[@]}"
    local n1 r2 r4 n40 n41 acc
    n1=$(field "$W/d1.worker0.json" params_sha256 || echo none); r2=$(field "$W/r2.json" params_sha256 || echo none)
    r4=$(field "$W/r4.json" params_sha256 || echo none); acc=$(field "$W/r4.json" test_accuracy || echo 0)
    n40=$(field "$W/n4.worker0.json" params_sha256 || echo none); n41=$(field "$W/n4.worker1.json" params_sha256 || echo none)
    say ""
    say "| replicas in one daemon (--devices; mnist-cnn, 300 steps of batch 32 per slot) | figure | result |"
    say "|---|---|---|"
    check "one daemon, 2 replicas on the GPU: bitwise the 2-rank NCCL run" "${r2:0:16} / ${n1:0:16}" \
        "$([ "$r2" = "$n1" ] && echo 1 || echo 0)"
    check "2 daemons of 2 replicas over NCCL: bitwise one daemon of 4 (accuracy $acc)" \
        "${n40:0:16} / ${n41:0:16} / ${r4:0:16}" "$([ "$n40" = "$r4" ] && [ "$n41" = "$r4" ] && echo 1 || echo 0)"
    check "the start-up line names the replicas" "$(grep -m1 -o 'on 2 replicas (.*) with' "$W/r2.log" | sed 's/ with$//' || echo none)" \
        "$(grep -q 'on 2 replicas (' "$W/r2.log" && echo 1 || echo 0)"
}

# A pair NAME whose worker VICTIM is, at step 372 of 937, SIGKILLed and restarted at once (kill)
# or stopped for 3 s, past the heartbeat deadline, and woken (freeze); to the end.
nccl_disturbed() {
    local name=$1 victim=$2 how=$3
    shift 3
    P0=$(free_port); P1=$(free_port)
    local pids=()
    nccl_worker 0 "$name" "$@" &
    pids[0]=$!
    nccl_worker 1 "$name" "$@" &
    pids[1]=$!
    until grep -q "^372/937" "$W/$name.worker0.log" 2>/dev/null; do sleep 0.05; kill -0 "${pids[0]}" 2>/dev/null || break; done
    if [ "$how" = kill ]; then
        kill -9 "${pids[$victim]}" 2>/dev/null || true
        wait "${pids[$victim]}" 2>/dev/null || true
        nccl_worker "$victim" "$name" "$@" &
        pids[$victim]=$!
    else
        kill -STOP "${pids[$victim]}"; sleep 3; kill -CONT "${pids[$victim]}"
    fi
    wait "${pids[0]}"; wait "${pids[1]}"
}

# The survivor's first recovery time in a summary.
recovery() {
    "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))['fault_tolerance']['recovery_seconds']; print(f'{r[0]:.2f} s' if r else 'none')" "$1"
}

# The check that pair NAME (SURVIVOR: the worker that lived through it) lost no step and ended
# bitwise equal to the uninterrupted run ($a0), both workers; FIGURE goes before the figures.
survived() {
    local name=$1 survivor=$2 what=$3 figure=$4 s0 s1 lost
    s0=$(field "$W/$name.worker0.json" params_sha256 || echo none); s1=$(field "$W/$name.worker1.json" params_sha256 || echo none)
    lost=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['fault_tolerance']['steps_lost'])" "$W/$name.worker$survivor.json" || echo "?")
    check "$what" "${figure}${lost} steps lost; ${s0:0:16} / ${s1:0:16}" \
        "$([ "$s0" = "$a0" ] && [ "$s1" = "$a0" ] && [ "$lost" = 0 ] && echo 1 || echo 0)"
}

# All-reduce on the GPU's buffers (trainerd's NCCL path, its host-staged ring, torch.distributed's
# NCCL), and mnist-cnn-big's training examples/s with 2 ranks beside DDP over NCCL.
nccl_bench() {
    echo "gpu-check: all-reduce, 2 ranks on one GPU" >&2
    NCCL_SOCKET_IFNAME=lo "$BUNDLE/bin/allreduce" 2 cuda:0 > "$W/ar.ours.log" 2>&1 || true
    "$PY" bench/nccl_allreduce.py 2 cuda:0 "$(free_port)" > "$W/ar.torch.log" 2>&1 || true
    say ""
    say "| all-reduce, 2 ranks on one GPU (NCCL over sockets on loopback) | trainerd NCCL | trainerd host-staged ring | torch.distributed NCCL | NCCL ratio |"
    say "|---|---|---|---|---|"
    local size
    for size in 4096 1048576 26214400 104857600; do
        local col=busbw_GBps unit="GB/s busbw"
        [ $size = 4096 ] && col=median_ms && unit="ms"
        pick() { grep "^$1 world=2 bytes=$size " "$2" | sed -E "s/.*$col=([0-9.]+).*/\1/"; }
        local n r t ratio
        n=$(pick trainerd-nccl "$W/ar.ours.log"); r=$(pick trainerd-ring "$W/ar.ours.log"); t=$(pick torch-nccl "$W/ar.torch.log")
        if [ -n "$n" ] && [ -n "$t" ]; then
            if [ $size = 4096 ]; then ratio=$("$PY" -c "print(f'{$t/$n:.2f}x (latency, >1 is faster)')"); else ratio=$("$PY" -c "print(f'{$n/$t:.2f}x')"); fi
        else ratio="-"; fi
        say "| $((size / 1024)) KiB | ${n:-failed} $unit | ${r:-failed} $unit | ${t:-failed} $unit | $ratio |"
    done
    grep -h "^communicator" "$W/ar.ours.log" | sed 's/^/    /' | tee -a "$report" || true
    training_bench
}

# mnist-cnn-big's training examples/s with 2 ranks on the GPU: trainerd over NCCL and over the
# ring, beside DDP over NCCL (with and without deterministic settings).
training_bench() {
    echo "gpu-check: mnist-cnn-big, 2 ranks, trainerd (NCCL, ring) and DDP over NCCL" >&2
    local big=(--plugin "$BUNDLE/bin/libmnist_cnn_big.so" --data "$D" --seed 7 --batch-size 256 --epochs 2 --steps-per-epoch 120 --no-evaluation --threads "${GPU_CHECK_THREADS:-4}")
    TRAINERD_LOG=trainerd=debug nccl_pair tb "${big[@]}"
    local ours ring ddp det
    ours=$(last_rate "$W/tb.worker0.log")
    "$T" local --workers 2 "${big[@]}" --device "$DEVICE" > "$W/tr.log" 2>&1 || true
    ring=$(grep -E "^\[worker 0\] [0-9]+/[0-9]+ - .* examples/s$" "$W/tr.log" | tail -1 | sed -E 's/.* - ([0-9,]+) examples\/s$/\1/; s/,//g')
    # Both with the same intra-op threads per rank (16 per process on a 16-core machine, two
    # processes and NCCL's proxy threads oversubscribe it: 4x slower batches for both).
    TORCH_THREADS="${GPU_CHECK_THREADS:-4}" "$PY" bench/gpu_ddp.py "$D" 256 200 cuda:0 "$(free_port)" > "$W/ddp.log" 2>&1 || true
    TORCH_THREADS="${GPU_CHECK_THREADS:-4}" "$PY" bench/gpu_ddp.py "$D" 256 200 cuda:0 --deterministic "$(free_port)" > "$W/ddpd.log" 2>&1 || true
    ddp=$(grep -o "examples_per_s=[0-9]*" "$W/ddp.log" | cut -d= -f2); det=$(grep -o "examples_per_s=[0-9]*" "$W/ddpd.log" | cut -d= -f2)
    say ""
    say "| mnist-cnn-big, 2 ranks on one GPU, batch 256 per rank | trainerd NCCL | trainerd ring | DDP over NCCL | ratio | DDP, deterministic | ratio |"
    say "|---|---|---|---|---|---|---|"
    local r1="-" r2="-"
    [ -n "$ours" ] && [ -n "$ddp" ] && r1=$("$PY" -c "print(f'{$ours/$ddp:.2f}x')")
    [ -n "$ours" ] && [ -n "$det" ] && r2=$("$PY" -c "print(f'{$ours/$det:.2f}x')")
    say "| examples/s (global) | ${ours:-failed} | ${ring:-failed} | ${ddp:-failed} | $r1 | ${det:-failed} | $r2 |"
}

# --precision bf16 and fp16 on the GPU: accuracy within 0.01 of fp32's (a.json, from the
# correctness checks, or made here), a repeat bitwise equal, and examples/s beside PyTorch eager
# under torch.autocast (fp16 with a GradScaler) on the same GPU.
precision_checks() {
    [ -f "$W/a.json" ] || "$T" run "${cnn[@]}" --device "$DEVICE" --epochs 1 --summary "$W/a.json" > "$W/a.log" 2>&1
    local acc32
    acc32=$(field "$W/a.json" test_accuracy)
    say ""
    say "| precision, 1 worker on cuda:0, 1 epoch | test accuracy (fp32 $acc32) | repeat | skipped steps | trainerd examples/s | PyTorch autocast, same work | ratio |"
    say "|---|---|---|---|---|---|---|"
    for p in bf16 fp16; do
        echo "gpu-check: --precision $p" >&2
        "$T" run "${cnn[@]}" --device "$DEVICE" --epochs 1 --precision $p --summary "$W/$p.json" > "$W/$p.log" 2>&1
        "$T" run "${cnn[@]}" --device "$DEVICE" --epochs 1 --precision $p --summary "$W/$p-again.json" > "$W/$p-again.log" 2>&1
        "$PY" bench/gpu_eager.py "$D" 64 900 "${DEVICE/cuda/cuda:0}" --autocast $p > "$W/e-$p.log" 2>&1 || true
        local acc sha again skipped ours peer
        acc=$(field "$W/$p.json" test_accuracy); sha=$(field "$W/$p.json" params_sha256); again=$(field "$W/$p-again.json" params_sha256)
        skipped=$("$PY" -c "import json,sys; s=json.load(open(sys.argv[1])).get('loss_scale'); print(s['skipped'] if s else '-')" "$W/$p.json")
        ours=$(last_rate "$W/$p.log")
        peer=$(grep "loop=same-work-$p" "$W/e-$p.log" | sed -E 's/.*examples_per_s=([0-9]+).*/\1/')
        local ok
        ok=$("$PY" -c "print(int(abs($acc - $acc32) <= 0.01 and '$sha' == '$again'))")
        say "| $p | $acc | $([ "$sha" = "$again" ] && echo same || echo DIFFERENT) | $skipped | $ours | ${peer:-failed} | $([ -n "$peer" ] && "$PY" -c "print(f'{$ours/$peer:.2f}x')" || echo -) |"
        [ "$ok" = 1 ] || failed=1
    done
}

# A model written in PyTorch, scripted with this machine's PyTorch (TorchScript files load only in
# a libtorch as new as the one that wrote them), trained by the torchscript plugin on the GPU:
# the tutorials' CNN to the same accuracy bar as the Rust plugin's, twice with the same bits.
torchscript_checks() {
    echo "gpu-check: the tutorials' CNN from PyTorch, through the torchscript plugin" >&2
    "$PY" plugins/torchscript/examples/script.py cnn "$W/cnn.pt" > "$W/script.log" 2>&1
    local ts=(--plugin "$BUNDLE/bin/libtorchscript.so" --plugin-arg "module=$W/cnn.pt" --data "$D" --threads 1 --seed 7)
    "$T" run "${ts[@]}" --device "$DEVICE" --epochs 1 --summary "$W/ts.json" > "$W/ts.log" 2>&1
    "$T" run "${ts[@]}" --device "$DEVICE" --epochs 1 --summary "$W/ts-again.json" > "$W/ts-again.log" 2>&1
    local acc sha again
    acc=$(field "$W/ts.json" test_accuracy); sha=$(field "$W/ts.json" params_sha256); again=$(field "$W/ts-again.json" params_sha256)
    say ""
    say "| torchscript plugin, the CNN scripted by PyTorch $("$PY" -c 'import torch; print(torch.__version__)'), 1 epoch on cuda:0 | figure | result |"
    say "|---|---|---|"
    check "test accuracy >= 0.85" "$acc" "$("$PY" -c "print(int($acc >= 0.85))")"
    check "same run twice: same params_sha256" "${sha:0:16} / ${again:0:16}" "$([ "$sha" = "$again" ] && echo 1 || echo 0)"
}

# examples/s of trainerd and of PyTorch eager, both with their default thread counts.
throughput_checks() {
    say ""
    say "| examples/s, 1 worker on cuda:0 | trainerd | PyTorch eager, same work | ratio | PyTorch eager, same work, deterministic | ratio | PyTorch eager, best case |"
    say "|---|---|---|---|---|---|---|"
    for b in 64 512; do
        echo "gpu-check: throughput at batch $b" >&2
        local steps=$((b == 64 ? 900 : 117)) ours=() peer=() best=() det=()
        for i in 1 2 3; do
            "$T" run --plugin "$CNN" --data "$D" --seed 7 --device "$DEVICE" --batch-size $b --epochs 3 --steps-per-epoch $steps > "$W/t$b.$i.log" 2>&1
            ours+=("$(last_rate "$W/t$b.$i.log")")
            "$PY" bench/gpu_eager.py "$D" $b $steps "${DEVICE/cuda/cuda:0}" > "$W/e$b.$i.log" 2>&1
            peer+=("$(grep "loop=same-work" "$W/e$b.$i.log" | sed -E 's/.*examples_per_s=([0-9]+).*/\1/')")
            best+=("$(grep "loop=best-case" "$W/e$b.$i.log" | sed -E 's/.*examples_per_s=([0-9]+).*/\1/')")
            "$PY" bench/gpu_eager.py "$D" $b $steps "${DEVICE/cuda/cuda:0}" --deterministic > "$W/d$b.$i.log" 2>&1
            det+=("$(grep "loop=same-work-deterministic" "$W/d$b.$i.log" | sed -E 's/.*examples_per_s=([0-9]+).*/\1/')")
        done
        local mo mp mb md
        median() { printf "%s\n" "$@" | sort -n | sed -n 2p; }
        mo=$(median "${ours[@]}"); mp=$(median "${peer[@]}"); mb=$(median "${best[@]}"); md=$(median "${det[@]}")
        say "| batch $b (median of 3) | $mo | $mp | $("$PY" -c "print(f'{$mo/$mp:.2f}x')") | $md | $("$PY" -c "print(f'{$mo/$md:.2f}x')") | $mb |"
        if [ $b = 512 ] && ! "$PY" -c "import sys; sys.exit(0 if $mo >= $mp else 1)"; then failed=1; fi
    done
}

case "${1:-prepare}" in
    prepare) prepare ;;
    run) run_checks ;;
    *) echo "usage: scripts/gpu-check.sh [prepare|run]" >&2; exit 2 ;;
esac
