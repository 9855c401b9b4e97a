//! The workspace's own build (`cargo build --workspace` makes it before the tests) and the
//! dataset the tests train on.

use std::path::{Path, PathBuf};

/// The directory holding the workspace's binaries and plugins (a test executable lives in its
/// `deps/`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The `trainerd` binary.
pub fn trainerd() -> PathBuf {
    let path = build_dir().join("trainerd");
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` first", path.display());
    path
}

/// A plugin library, by crate name.
pub fn plugin(name: &str) -> PathBuf {
    let path = build_dir().join(format!("lib{}.so", name.replace('-', "_")));
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` first", path.display());
    path
}

/// Fashion-MNIST (scripts/setup.sh installs it), or the MNIST-format directory in
/// `TRAINERD_TEST_DATA`.
pub fn dataset() -> PathBuf {
    let dir = std::env::var_os("TRAINERD_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/share/datasets/fashion-mnist".into());
    assert!(dir.join("train-images-idx3-ubyte.gz").exists(), "no dataset in {}: run scripts/setup.sh", dir.display());
    dir
}

/// A command running the workspace's `trainerd`.
pub fn trainerd_cmd() -> std::process::Command {
    std::process::Command::new(trainerd())
}
