#!/usr/bin/env bash
# The whole test suite: installs what is needed, checks formatting, sizes and lints, builds every
# crate (the plugins the tests load included), and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --tests --no-build
source scripts/env.sh
cargo fmt --all --check
# Sizes: no function over 60 lines (clap's argument structs and tests aside), no file over 600
# non-test lines, in the daemon, storage, the SDK and the data crate.
python3 scripts/rust_sizes.py 60 600 daemon/src storage/src sdk/src data/src
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace
# What the main command builds (release): the README test runs the quick start's blocks as written,
# and their build step then finds it done rather than compiling while the other tests run.
cargo build --release -p trainerd -p mnist-cnn -p python-model
# Every test binary runs even after one fails (cargo stops at the first failing binary by
# default, which hid every suite after it); the exit status is still non-zero on any failure.
cargo test --workspace --no-fail-fast
