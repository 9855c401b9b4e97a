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
#   EXAMPLE=gpt        the language-model job instead: the small GPT of
#                      plugins/python-model/examples/gpt.py on raw text (the licenses of
#                      /usr/share/common-licenses, one document each, written once into
#                      runs/licenses-text with their tokenizer.json by tokenize.py --raw), tokenized
#                      and packed by trainerd into blocks of 128 tokens, on 2 workers, with AdamW
#                      (weight decay 0.1, betas 0.9/0.95), a warmup over the first 10% of the steps
#                      and a cosine decay; checkpoints in runs/gpt/checkpoints
# Extra arguments go to every `trainerd run` (e.g. --epochs 1, --optimizer sgd --lr 0.01,
# --summary out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${EXAMPLE:-mnist-cnn}" = gpt ]; then
    text=runs/licenses-text
    if [ ! -e "$text/tokenizer.json" ]; then
        echo "train: writing the licenses' text and a byte-level BPE tokenizer into $text"
        rm -rf "$text.partial"
        scripts/python plugins/python-model/examples/tokenize.py --raw --out "$text.partial"
        mv "$text.partial" "$text"
    fi
    checkpoints="${CHECKPOINT_DIR:-runs/gpt/checkpoints}"
    echo "train: checkpoints in $checkpoints (remove it to start over)"
    exec target/release/trainerd local --workers "${WORKERS:-2}" \
        --plugin target/release/libpython_model.so \
        --plugin-arg module=plugins/python-model/examples/gpt.py --plugin-arg input=text \
        --data "$text" --batch-size 8 --epochs 2 \
        --optimizer adamw --lr 2e-3 --weight-decay 0.1 --adam-beta2 0.95 \
        --warmup-steps 0.1 --lr-schedule cosine \
        --checkpoint-dir "$checkpoints" --checkpoint-every 50 \
        "$@"
elif [ "${EXAMPLE:-mnist-cnn}" != mnist-cnn ]; then
    echo "train: EXAMPLE=${EXAMPLE}: expected mnist-cnn (the default) or gpt" >&2
    exit 2
fi
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
