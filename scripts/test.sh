#!/usr/bin/env bash
# The whole test suite: checks formatting and sizes, installs what is needed, builds every crate
# (the plugins the tests load included), lints, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
# Sizes: no function over 60 lines (clap's argument structs and tests aside), no file over 600
# non-test lines, in the daemon, storage, the SDK and the data crate.
python3 scripts/rust_sizes.py 60 600 daemon/src storage/src sdk/src data/src
# Installs, and builds every crate in release; on a fresh machine the crates that do not need
# libtorch compile while PyTorch downloads.
scripts/setup.sh --tests --workspace
source scripts/env.sh
cargo clippy --workspace --all-targets -- -D warnings
# What the main command builds (its own feature set): the README test runs the quick start's
# blocks as written, and their build step then finds it done rather than compiling during a test.
cargo build --release -p trainerd -p mnist-cnn -p python-model
# The tests run what users run: the release build (the README test's quick-start blocks then find
# their build done). The daemon's own Rust (the ring's additions, encoding, hashing) unoptimised
# was half of a training step's time, and the suite had outgrown CI's 90 minutes in the debug build.
# Every test binary runs even after one fails (cargo stops at the first failing binary by
# default, which hid every suite after it); the exit status is still non-zero on any failure.
cargo test --workspace --release --no-fail-fast
