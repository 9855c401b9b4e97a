# Sourced by the scripts: puts the PyTorch virtualenv that trainerd builds against on PATH.
# The venv lives outside the clone, keyed by version, so fresh clones reuse it.
TORCH_VERSION=2.13.0
# Keras 3, whose torch backend runs Keras models through the Python model plugin.
KERAS_VERSION=3.15.1
TRAINERD_CACHE="${TRAINERD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainerd}"
TRAINERD_VENV="$TRAINERD_CACHE/venv-torch-$TORCH_VERSION"
export VIRTUAL_ENV="$TRAINERD_VENV"
export PATH="$TRAINERD_VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
# The Python model plugin embeds this venv's interpreter (pyo3 and its build script ask it).
export PYO3_PYTHON="$TRAINERD_VENV/bin/python"
