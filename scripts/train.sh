#!/usr/bin/env bash
# The main job: installs what is needed, then trains the tutorials' CNN on Fashion-MNIST with two
# workers on this machine (`trainerd local`: two daemons, each with its own TF_CONFIG, ring
# all-reduce between them), evaluating on the test split after each epoch.
# WORKERS=N changes the worker count; extra arguments go to every `trainerd run`
# (e.g. --epochs 1, --optimizer sgd --lr 0.01, --summary out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec target/release/trainerd local --workers "${WORKERS:-2}" \
    --plugin target/release/libmnist_cnn.so \
    --data /usr/share/datasets/fashion-mnist \
    "$@"
