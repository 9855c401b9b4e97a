#!/usr/bin/env bash
# The whole test suite: installs what is needed, checks formatting and lints, builds every
# crate (the plugins the tests load included), and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-build
source scripts/env.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace
cargo test --workspace
