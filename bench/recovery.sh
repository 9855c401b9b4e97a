#!/usr/bin/env bash
# Recovery after a lost worker: trainerd (kills of a worker, of the chief, freezes) beside torchrun's
# restart-everything (../shared/bench/torchrun_recovery.py), same session. See bench/recovery.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec python bench/recovery.py "$@"
