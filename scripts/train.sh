#!/usr/bin/env bash
# The main job: installs what is needed, then trains the tutorials' CNN on Fashion-MNIST with two
# workers on this machine (`trainerd local`: two daemons, each with its own TF_CONFIG, ring
# all-reduce between them), evaluating on the test split after each epoch and committing
# checkpoints to a local directory. Run it again after a crash or Ctrl-C and it resumes from the
# last commit; remove the directory to start over.
#   WORKERS=N          worker count (default 2)
#   CHECKPOINT_DIR=... where checkpoints go (default runs/mnist-cnn/checkpoints; s3:// works too)
#   DATA=...           the dataset (default the idx files of /usr/share/datasets/fashion-mnist):
#                      a directory or s3://bucket/prefix of Parquet files in Hugging Face's layout,
#                      or DATA=parquet for Fashion-MNIST as Parquet (written once into
#                      runs/fashion-mnist-parquet by `trainerd data convert`)
# Extra arguments go to every `trainerd run` (e.g. --epochs 1, --optimizer sgd --lr 0.01,
# --summary out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
checkpoints="${CHECKPOINT_DIR:-runs/mnist-cnn/checkpoints}"
data="${DATA:-/usr/share/datasets/fashion-mnist}"
if [ "$data" = parquet ]; then
    data=runs/fashion-mnist-parquet
    if [ ! -d "$data" ]; then
        echo "train: writing Fashion-MNIST as Parquet in Hugging Face's layout into $data"
        rm -rf "$data.partial"
        target/release/trainerd data convert /usr/share/datasets/fashion-mnist "$data.partial"
        mv "$data.partial" "$data"
    fi
fi
echo "train: checkpoints in $checkpoints (remove it to start over)"
exec target/release/trainerd local --workers "${WORKERS:-2}" \
    --plugin target/release/libmnist_cnn.so \
    --data "$data" \
    --checkpoint-dir "$checkpoints" --checkpoint-every 200 \
    "$@"
