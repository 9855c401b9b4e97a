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
COLLECTIVE=$([ "$DEVICE" = cpu ] && echo ring || echo nccl)

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
    local python
    python=$(python_for_gpu)
    PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1 \
        PYO3_PYTHON="$python/python3.12-probe" PYO3_CONFIG_FILE="$python/pyo3-config.txt" \
        CARGO_TARGET_DIR=target/gpu cargo build --release -p python-model \
        --config "patch.crates-io.torch-sys.path=\"$sys\""
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin" "$BUNDLE/data" "$BUNDLE/pylib" "$BUNDLE/whl"
    for f in trainerd libmnist_cnn.so libmnist_cnn_big.so liblinear.so libtorchscript.so libpython_model.so; do
        strip -o "$BUNDLE/bin/$f" "target/gpu/release/$f"
    done
    strip -o "$BUNDLE/bin/allreduce" "$bench"
    # The largest files travel compressed (the bundle and the checkout must stay under 64 MiB).
    xz -T2 -6 "$BUNDLE/bin/trainerd" "$BUNDLE/bin/allreduce"
    xz -T2 -6 -c "$python/root/usr/lib/x86_64-linux-gnu/libpython3.12.so.1.0" > "$BUNDLE/pylib/libpython3.12.so.1.0.xz"
    scripts/setup.sh --no-build >/dev/null
    cp /usr/share/datasets/fashion-mnist/*.gz "$BUNDLE/data/"
    # Keras (not on the GPU machine) and what it needs that is not there either, as wheels for its
    # Python; the GPT example's token Parquet (tokenize.py's defaults).
    "$TRAINERD_VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$BUNDLE/whl" \
        "keras==$KERAS_VERSION" namex "optree==$("$TRAINERD_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("optree"))')"
    "$TRAINERD_VENV/bin/python" plugins/python-model/examples/tokenize.py --out "$BUNDLE/lm-gpt" >/dev/null
    echo "gpu-check: $BUNDLE is ready ($(du -sh "$BUNDLE" | cut -f1)); on the GPU machine, with $BUNDLE carried: scripts/gpu-check.sh run"
}

# Python 3.12 as the GPU machine has it (/opt/torch/.venv is made from Ubuntu 24.04's), for the
# Python model plugin, which embeds the interpreter: Ubuntu's libpython3.12 and its headers from
# Ubuntu's archive (unpacked, not installed), a script that answers the plugin's build script as that
# Python would (this machine's 3.11 cannot stand for it), and a pyo3 configuration in place of an
# interpreter. At run time the plugin takes that machine's base Python and packages from
# TRAINERD_PYTHON_HOME and TRAINERD_PYTHON_SITE. Prints the directory.
python_for_gpu() {
    local py="$TRAINERD_CACHE/python-3.12-ubuntu-noble"
    if [ ! -e "$py/.trainerd-complete" ]; then
        echo "gpu-check: fetching Python 3.12's libpython and headers from Ubuntu 24.04 into $py" >&2
        rm -rf "$py" && mkdir -p "$py/debs"
        local archive=http://archive.ubuntu.com/ubuntu index pkg file
        index=$(curl -fsS "$archive/dists/noble-updates/main/binary-amd64/Packages.gz" | gunzip)
        for pkg in libpython3.12t64 libpython3.12-dev; do
            file=$(awk -v p="$pkg" '$1 == "Package:" { hit = ($2 == p) } hit && $1 == "Filename:" { print $2; exit }' <<< "$index")
            curl -fsS -o "$py/debs/${file##*/}" "$archive/$file"
            dpkg -x "$py/debs/${file##*/}" "$py/root"
        done
        # One include directory: Ubuntu's pyconfig.h only points at the architecture's own.
        cp -r "$py/root/usr/include/python3.12" "$py/include"
        cp "$py/root/usr/include/x86_64-linux-gnu/python3.12/pyconfig.h" "$py/include/pyconfig.h"
        touch "$py/.trainerd-complete"
    fi
    local lib="$py/root/usr/lib/x86_64-linux-gnu"
    printf '#!/bin/sh\n# What the GPU machine'"'"'s Python 3.12 would answer python-model'"'"'s build script.\nprintf "%%s\\n" /usr %s libpython3.12.so %s /opt/torch/.venv/lib/python3.12/site-packages 3.12 /opt/torch/.venv/bin/python3\n' \
        "$lib" "$py/include" > "$py/python3.12-probe"
    chmod +x "$py/python3.12-probe"
    printf '%s\n' implementation=CPython version=3.12 shared=true abi3=false lib_name=python3.12 "lib_dir=$lib" \
        executable=/opt/torch/.venv/bin/python3 pointer_width=64 build_flags= > "$py/pyo3-config.txt"
    echo "$py"
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
    local f
    for f in "$BUNDLE"/bin/*.xz "$BUNDLE"/pylib/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
    # The Python model plugin: this machine's base Python and packages, its libpython (the bundle's
    # where it has none), and Keras from the bundle's wheels where it is not installed.
    export TRAINERD_PYTHON_HOME TRAINERD_PYTHON_SITE
    TRAINERD_PYTHON_HOME=$("$PY" -c 'import sys; print(sys.base_prefix)')
    TRAINERD_PYTHON_SITE=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    local pylib
    pylib=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
    export LD_LIBRARY_PATH="$lib:$pylib:$(realpath "$BUNDLE")/pylib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    if ! "$PY" -c "import keras" 2>/dev/null && compgen -G "$BUNDLE/whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/trainerd-site "$BUNDLE"/whl/*.whl
        export PYTHONPATH="/tmp/trainerd-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local T="$BUNDLE/bin/trainerd" CNN="$BUNDLE/bin/libmnist_cnn.so" D="$BUNDLE/data" PYM="$BUNDLE/bin/libpython_model.so"
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
    # Three workers' job of the return and replica checks (600 steps: on an H200 a 300-step run
    # ended before a worker started again was back).
    local three=("${cnn[@]}" --batch-size 32 --epochs 1 --steps-per-epoch 600)
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
        # The checks that had not run on a GPU by 2026-11-30 (the GPT example in bf16 beside DDP,
        # mnist-cnn-big beside DDP, catch-up, the replica check, sharding, Keras; about 7 minutes),
        # then the first correctness checks.
        new) gpt_checks; training_bench; recovery_checks; keras_checks; correctness_checks ;;
        gpt) gpt_checks ;;
        recovery) recovery_checks ;;
        ring) ring_return_checks ;;
        keras) keras_checks ;;
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

# Worker RANK of a cluster on the ports $PORTS (two by default: $P0 $P1), over NCCL on the one GPU
# (its own NCCL_HOSTID, NCCL's sockets on loopback; the ring with GPU_CHECK_DEVICE=cpu), writing
# $W/NAME.workerRANK.{log,json}. Run it in the background only: it becomes the trainerd process
# (so $! is the worker's pid).
nccl_worker() {
    local r=$1 name=$2 workers="" p
    shift 2
    for p in ${PORTS:-$P0 $P1}; do workers+="${workers:+,}\"127.0.0.1:$p\""; done
    TF_CONFIG="{\"cluster\":{\"worker\":[$workers]},\"task\":{\"type\":\"worker\",\"index\":$r}}" \
        NCCL_HOSTID="gpu-check-$r" NCCL_SOCKET_IFNAME=lo \
        exec "$T" run ${PLACE:---device $DEVICE} --collective "$COLLECTIVE" --summary "$W/$name.worker$r.json" "$@" \
        >> "$W/$name.worker$r.log" 2>&1
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

# Two ranks over NCCL training the GPT example as NAME, in PRECISION, BATCH per rank, EPOCHS.
gpt_pair() {
    nccl_pair "$1" --plugin "$PYM" --plugin-arg "module=plugins/python-model/examples/gpt.py" --data "$BUNDLE/lm-gpt" \
        --batch-size "$3" --epochs "$4" --optimizer adam --lr 1e-3 --seed 0 --no-evaluation --threads 1 --precision "$2"
}

# The GPT example (plugins/python-model/examples/gpt.py, 0.48 M parameters, Adam) through the
# Python model plugin, 2 ranks over NCCL on the GPU, beside DDP over NCCL (bench/gpu_gpt.py: the
# same module, weights, batch, steps; bf16 under torch.autocast): tokens/s, and the ranks identical.
gpt_checks() {
    local data="$BUNDLE/lm-gpt" rows spec p b epochs steps name
    rows=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['blocks']['train'])" "$data/meta.json")
    say ""
    say "| the GPT example, 2 ranks on one GPU, each its batch of 128-token rows | trainerd over NCCL, tokens/s | ranks identical | DDP over NCCL, tokens/s | ratio |"
    say "|---|---|---|---|---|"
    for spec in "bf16 16 15" "bf16 64 60" "fp32 16 15"; do
        read -r p b epochs <<< "$spec"
        steps=$((rows / (2 * b) * epochs)) name=gpt-$p-$b
        echo "gpu-check: the GPT example, $p, batch $b per rank, $steps steps, trainerd and DDP" >&2
        gpt_pair "$name" "$p" "$b" "$epochs"
        TORCH_THREADS=1 "$PY" bench/gpu_gpt.py "$data" "$b" $((steps - 10)) --warmup 10 --precision "$p" \
            --device "${DEVICE/cuda/cuda:0}" --port "$(free_port)" > "$W/$name.ddp.log" 2>&1 || true
        local ours s0 s1 ddp ratio="-"
        ours=$("$PY" -c "import json, sys; print(round(json.load(open(sys.argv[1]))['examples_per_second'] * 128))" \
            "$W/$name.worker0.json" 2>/dev/null || true)
        s0=$(field "$W/$name.worker0.json" params_sha256 2>/dev/null || echo none)
        s1=$(field "$W/$name.worker1.json" params_sha256 2>/dev/null || echo none)
        ddp=$(grep -o "tokens_per_s=[0-9]*" "$W/$name.ddp.log" | cut -d= -f2 || true)
        [ -n "$ours" ] && [ -n "$ddp" ] && ratio=$("$PY" -c "print(f'{$ours/$ddp:.2f}x')")
        say "| $p, batch $b, $steps steps | ${ours:-failed} | $([ "$(same "$s0" "$s1")" = 1 ] && echo "yes" || echo "NO") | ${ddp:-failed} | $ratio |"
        [ "$(same "$s0" "$s1")" = 1 ] || failed=1
    done
    # Attention's backward pass on CUDA (flash or memory-efficient) is deterministic only with
    # libtorch's deterministic algorithms strict (trainerd's default since 2026-11-30; before,
    # warn-only, it ran the non-deterministic one and said so in a libtorch warning).
    echo "gpu-check: the GPT example, bf16, batch 16 per rank, again" >&2
    gpt_pair gpt-again bf16 16 15
    local first again
    first=$(field "$W/gpt-bf16-16.worker0.json" params_sha256 2>/dev/null || echo none)
    again=$(field "$W/gpt-again.worker0.json" params_sha256 2>/dev/null || echo none)
    say ""
    say "| the GPT example on the GPU | figure | result |"
    say "|---|---|---|"
    check "bf16, batch 16, the same run twice: same params_sha256" "${first:0:16} / ${again:0:16}" \
        "$(same "$first" "$again")"
    check "no libtorch warning of a non-deterministic algorithm" \
        "$(grep -h -m1 -o "Warning: [A-Za-z ]* defaults to a non-deterministic algorithm" "$W"/gpt-*.worker*.log || echo none)" \
        "$(grep -q "non-deterministic algorithm" "$W"/gpt-*.worker*.log && echo 0 || echo 1)"
}

# Three workers over NCCL (the job $three), as NAME: worker VICTIM SIGKILLed at step 120 and
# started again 0.5 s later while the two others train on (HOW=kill), or a bit of its parameters
# flipped after step 150 (HOW=flip), or neither (HOW=none); to the end.
trio() {
    local name=$1 victim=$2 how=$3 r PORTS
    local pids=()
    shift 3
    PORTS="$(free_port) $(free_port) $(free_port)"
    for r in 0 1 2; do
        if [ "$how" = flip ] && [ "$r" = "$victim" ]; then
            TRAINERD_FAILPOINT=flip-bit@150 nccl_worker "$r" "$name" "$@" &
        else
            nccl_worker "$r" "$name" "$@" &
        fi
        pids[r]=$!
    done
    if [ "$how" = kill ]; then
        # (Progress lines are right-aligned: " 120/600".)
        until grep -q "^ *120/600" "$W/$name.worker0.log" 2>/dev/null; do sleep 0.05; kill -0 "${pids[0]}" 2>/dev/null || break; done
        kill -9 "${pids[victim]}" 2>/dev/null || true
        wait "${pids[victim]}" 2>/dev/null || true
        sleep 0.5
        # Not after the run's end: without commits to show it, a worker back then would wait on.
        if kill -0 "${pids[0]}" 2>/dev/null; then
            nccl_worker "$victim" "$name" "$@" &
            pids[victim]=$!
        fi
    fi
    for r in 0 1 2; do wait "${pids[r]}" || true; done
}

# Whether two params_sha256 are the same and there (1 or 0).
same() { [ "$1" = "$2" ] && [ "$1" != none ] && echo 1 || echo 0; }

# Whether NAME's three workers all ended with params_sha256 $ref (1 or 0).
all_equal() {
    local r sha
    for r in 0 1 2; do
        sha=$(field "$W/$1.worker$r.json" params_sha256 2>/dev/null || echo none)
        [ "$sha" = "$ref" ] || { echo 0; return; }
    done
    echo 1
}

# A return that catches up, and the replica check, on the GPU (never run there before
# 2026-11-30): three ranks over NCCL, rank 2 killed and back while the two others train, a bit of
# rank 1's parameters flipped; the same return over the host-staged ring (trainerd local); and
# --shard-optimizer on CUDA refused, saying so.
recovery_checks() {
    echo "gpu-check: 3 ranks over NCCL: uninterrupted, rank 2 killed and back, a bit of rank 1 flipped" >&2
    trio t3 0 none "${three[@]}"
    local ref caught lost mism
    ref=$(field "$W/t3.worker0.json" params_sha256 2>/dev/null || echo none)
    trio t3k 2 kill "${three[@]}"
    trio t3f 1 flip "${three[@]}" --replica-check-every 100
    say ""
    say "| catch-up and the replica check, 3 ranks of mnist-cnn on one GPU (600 steps of batch 32) | figure | result |"
    say "|---|---|---|"
    check "3 ranks over NCCL: identical params_sha256" "${ref:0:16}" "$(all_equal t3)"
    caught=$(grep -h -m1 "caught up in" "$W/t3k.worker2.log" | cut -c11- || true)
    lost=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['fault_tolerance']['steps_lost'])" "$W/t3k.worker0.json" 2>/dev/null || echo "?")
    check "NCCL, rank 2 killed at step 120 and back 0.5 s later: it catches up, 0 steps lost, bitwise equal" \
        "${caught:-no catch-up line}; $lost lost" "$([ -n "$caught" ] && [ "$lost" = 0 ] && all_equal t3k || echo 0)"
    mism=$("$PY" -c "import json, sys; m = json.load(open(sys.argv[1]))['integrity']['mismatches']; print('; '.join(f\"step {x['step']}: {', '.join(x['members'])}\" for x in m) or 'none')" \
        "$W/t3f.worker0.json" 2>/dev/null || echo "?")
    check "NCCL, a bit of rank 1's parameters flipped after step 150: named, repaired, bitwise equal" \
        "$(grep -h -m1 "failpoint flip-bit" "$W/t3f.worker1.log" | cut -c11-80 || true)...; mismatch at $mism" \
        "$(echo "$mism" | grep -q "worker 1 (" && all_equal t3f || echo 0)"
    ring_return_checks
}

# The same return over the host-staged ring (trainerd local), bitwise the NCCL run ($ref; without
# one, an uninterrupted ring run's), and --shard-optimizer on CUDA refused, saying why.
ring_return_checks() {
    local caught
    if [ -z "${ref:-}" ]; then
        local ref
        "$T" local --workers 3 "${three[@]}" --device "$DEVICE" --summary "$W/l3.json" > "$W/l3.log" 2>&1 || true
        ref=$(field "$W/l3.worker0.json" params_sha256 2>/dev/null || echo none)
        say ""
        say "| a return over the ring, 3 workers of mnist-cnn on one GPU (600 steps of batch 32) | figure | result |"
        say "|---|---|---|"
        check "3 workers over the ring: identical params_sha256" "${ref:0:16}" "$(all_equal l3)"
    fi
    echo "gpu-check: 3 workers over the host-staged ring (trainerd local), worker 2 killed and back" >&2
    "$T" local --workers 3 --restart-delay 0.5 "${three[@]}" --device "$DEVICE" --summary "$W/lr.json" > "$W/lr.log" 2>&1 &
    local lpid=$! wpid=""
    until [ -n "$wpid" ]; do
        sleep 0.1
        wpid=$(grep -o "worker 2 (pid [0-9]*)" "$W/lr.log" | grep -o "[0-9]*)" | tr -d ')' || true)
        kill -0 $lpid 2>/dev/null || break
    done
    until grep -q "^\[worker 0\]  *120/600" "$W/lr.log" 2>/dev/null; do sleep 0.05; kill -0 $lpid 2>/dev/null || break; done
    kill -9 "$wpid" 2>/dev/null || true
    wait $lpid || true
    caught=$(grep -m1 "caught up in" "$W/lr.log" | sed 's/^\[worker 2\] trainerd: //' || true)
    check "the ring, worker 2 killed at step 120 and back 0.5 s later: it catches up, bitwise the uninterrupted run" \
        "${caught:-no catch-up line}" "$([ -n "$caught" ] && all_equal lr || echo 0)"

    echo "gpu-check: --shard-optimizer on $DEVICE" >&2
    local refused
    refused=$("$T" run --plugin "$CNN" --data "$D" --threads 1 --epochs 1 --steps-per-epoch 5 --device "$DEVICE" --shard-optimizer 2>&1 |
        grep -m1 -o "\-\-shard-optimizer runs on the CPU so far.*" || true)
    check "--shard-optimizer on CUDA: refused, saying why" "${refused:0:90}..." "$([ -n "$refused" ] && echo 1 || echo 0)"
}

# A Keras model (the custom-training-loop tutorial's CNN, Keras 3 on its torch backend) through the
# Python model plugin on the GPU: 1 worker, 1 epoch, the test accuracy bar of the Rust CNN's; 2
# ranks over NCCL identical.
keras_checks() {
    local K=(--plugin "$PYM" --plugin-arg module=plugins/python-model/examples/keras_custom_loop.py --data "$D" --threads 1 --seed 7)
    echo "gpu-check: a Keras model, 1 worker for 1 epoch, then 2 ranks over NCCL" >&2
    "$T" run "${K[@]}" --device "$DEVICE" --epochs 1 --summary "$W/keras.json" > "$W/keras.log" 2>&1 || true
    nccl_pair kn "${K[@]}" --batch-size 32 --epochs 1 --steps-per-epoch 300
    local acc k0 k1
    acc=$(field "$W/keras.json" test_accuracy 2>/dev/null || echo 0)
    k0=$(field "$W/kn.worker0.json" params_sha256 2>/dev/null || echo none); k1=$(field "$W/kn.worker1.json" params_sha256 2>/dev/null || echo none)
    say ""
    say "| a Keras model (keras_custom_loop.py) on the GPU | figure | result |"
    say "|---|---|---|"
    check "1 worker, 1 epoch: test accuracy >= 0.85" "$acc" \
        "$("$PY" -c "print(int($acc >= 0.85))")"
    check "2 ranks over NCCL, 300 steps: identical params_sha256" "${k0:0:16} / ${k1:0:16}" \
        "$(same "$k0" "$k1")"
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
