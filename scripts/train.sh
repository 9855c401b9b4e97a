#!/usr/bin/env bash
# The main job: installs what is needed, then trains the tutorials' CNN on Fashion-MNIST and
# evaluates it on the test split after each epoch. Extra arguments go to `trainerd run`
# (e.g. --epochs 1, --optimizer sgd --lr 0.01, --summary out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec target/release/trainerd run \
    --plugin target/release/libmnist_cnn.so \
    --data /usr/share/datasets/fashion-mnist \
    "$@"
