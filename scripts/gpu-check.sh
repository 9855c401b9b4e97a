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
# (bench/gpu_eager.py) at batch 64 and 512.
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
    echo "gpu-check: building against PyTorch $GPU_TORCH into target/gpu"
    PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1 \
        CARGO_TARGET_DIR=target/gpu cargo build --release -p trainerd -p mnist-cnn -p linear \
        --config "patch.crates-io.torch-sys.path=\"$sys\""
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/bin" "$BUNDLE/data"
    for f in trainerd libmnist_cnn.so liblinear.so; do strip -o "$BUNDLE/bin/$f" "target/gpu/release/$f"; done
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
    # GPU_CHECK_ONLY=throughput: the examples/s table alone.
    [ "${GPU_CHECK_ONLY:-}" = throughput ] || correctness_checks
    throughput_checks
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
