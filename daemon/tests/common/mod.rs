//! Helpers shared by the daemon's integration tests: the built binary and plugins, the dataset,
//! and reading what a run printed.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `trainerd` binary under test.
pub fn trainerd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_trainerd"))
}

/// A plugin library built next to the daemon (`cargo build --workspace` builds them).
pub fn plugin(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_trainerd")).parent().unwrap();
    let path = dir.join(format!("lib{}.so", name.replace('-', "_")));
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` before the tests", path.display());
    path
}

/// Fashion-MNIST (scripts/setup.sh installs it), or the directory in `TRAINERD_TEST_DATA`.
pub fn fashion_mnist() -> PathBuf {
    let dir = std::env::var_os("TRAINERD_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/share/datasets/fashion-mnist".into());
    assert!(dir.join("train-images-idx3-ubyte.gz").exists(), "no dataset in {}: run scripts/setup.sh", dir.display());
    dir
}

/// Free loopback ports, and a worker's TF_CONFIG on them: the chaos tests' own.
#[allow(unused_imports)] // as dead_code above: not every test binary uses them
pub use trainerd_chaos_tests::{free_ports, tf_config};

/// Standard output and error, for assertion messages.
pub fn text(out: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Standard output.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Standard error.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `error: ...` line a run printed.
pub fn error_line(out: &Output) -> String {
    stderr(out)
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line; {}", text(out)))
        .to_string()
}

/// The error line of a run that failed with exit status 1 (an error, not a crash).
pub fn error_of(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{}", text(out));
    error_line(out)
}

/// A JSON file (a summary).
pub fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}
