#!/usr/bin/env bash
# Recovery after a lost worker: trainerd (kills of a worker, of the chief, freezes) beside torchrun's
# restart-everything (../shared/bench/torchrun_recovery.py), same session. See bench/recovery.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
# The linear plugin (--state-mb's wide table) is not among setup's plugins.
cargo build --release -p trainerd -p mnist-cnn -p python-model -p linear
exec python bench/recovery.py "$@"
