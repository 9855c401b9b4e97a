//! The workspace's own build (`cargo build --workspace` makes it before the tests), the
//! dataset the tests train on, and a directory copied.

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

/// The Python of the virtualenv with PyTorch that the build uses (`scripts/env.sh` activates it),
/// else `python3`.
pub fn python() -> PathBuf {
    std::env::var_os("VIRTUAL_ENV").map(|v| PathBuf::from(v).join("bin/python")).unwrap_or_else(|| "python3".into())
}

/// The python-model plugin's examples (`plugins/python-model/examples`), as an absolute path
/// without `..`, as the plugin names files.
pub fn python_examples() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/python-model/examples");
    std::fs::canonicalize(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
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

/// Token rows for the language-model examples: `tokenize.py`'s defaults (a 512-id byte-level BPE
/// over /usr/share/common-licenses, rows of 128 tokens), made once per test binary.
pub fn tokens() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let out = std::process::Command::new(python())
            .arg(python_examples().join("tokenize.py"))
            .arg("--out")
            .arg(dir.path())
            .output()
            .expect("tokenize.py");
        assert!(out.status.success(), "tokenize.py: {}", crate::output::text(&out));
        dir
    })
    .path()
}

/// Fashion-MNIST as Parquet in Hugging Face's layout, as `trainerd data convert` writes it: made
/// once per build of `trainerd` (its modification time names the copy) and kept beside the build.
pub fn parquet_dataset() -> PathBuf {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MADE.get_or_init(|| {
        let built = std::fs::metadata(trainerd()).and_then(|m| m.modified()).expect("trainerd's modification time");
        let key = built.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        // Whole once renamed into place.
        let dir = build_dir().join(format!("fashion-mnist-parquet-{key}"));
        if dir.is_dir() {
            return dir;
        }
        let tmp = build_dir().join(format!("fashion-mnist-parquet.tmp{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let out =
            trainerd_cmd().args(["data", "convert"]).arg(dataset()).arg(&tmp).output().expect("trainerd data convert");
        assert!(out.status.success(), "trainerd data convert: {}", crate::output::text(&out));
        // Another test binary may have made it meanwhile: either copy serves.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        for old in std::fs::read_dir(build_dir()).into_iter().flatten().flatten() {
            let name = old.file_name().to_string_lossy().into_owned();
            if name.starts_with("fashion-mnist-parquet-") && old.path() != dir {
                let _ = std::fs::remove_dir_all(old.path());
            }
        }
        dir
    })
    .clone()
}

/// A command running the workspace's `trainerd`.
pub fn trainerd_cmd() -> std::process::Command {
    std::process::Command::new(trainerd())
}

/// Copies the directory `from` (files and sub-directories) to `to`.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
