#!/usr/bin/env bash
# The randomized soak (chaos-tests/tests/soak.rs): 4 workers of the linear plugin train one job round
# after round for N minutes while a seeded random schedule kills workers (the chief included),
# freezes them, holds one down and brings it back, kills two close together, cuts the link to the
# S3 test server holding the checkpoints, partitions a worker in network namespaces (as root), and
# flips a bit in one replica. Every round must end bitwise equal to the failure-free run, with no
# hang and every commit verifying; each event is printed with the pause it caused, then a table.
#
# Usage: bench/soak.sh [--minutes N] [--seed S] [--dev]
#   --minutes N   how long (default 30); rounds of 96 epochs (about 5 minutes) and workers held down for minutes
#                 from 10 minutes up
#   --seed S      the schedule's seed (default 1); the same seed draws the same schedule
#   --dev         the debug build the test suite uses (default: release)
# Each round's full transcript is kept in $TMPDIR/trainerd-soak-seedS-roundR.log.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=30 seed=1 profile=(--release)
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) minutes="$2"; shift 2 ;;
        --seed) seed="$2"; shift 2 ;;
        --dev) profile=(); shift ;;
        *) echo "usage: bench/soak.sh [--minutes N] [--seed S] [--dev]" >&2; exit 2 ;;
    esac
done
scripts/setup.sh --tests --workspace
source scripts/env.sh
cargo build --workspace "${profile[@]}"
SOAK_MINUTES="$minutes" SOAK_SEED="$seed" \
    exec cargo test "${profile[@]}" -p trainerd-chaos-tests --test soak -- --nocapture --test-threads 1
