//! The README's "Models from PyTorch (Python files)" commands, taken from the README's own text
//! and run as a new user runs them after the main command: every `sh` block of the section, in
//! order, from the repository's root, with a clean environment (no virtualenv activated, nothing
//! of trainerd on `PATH`, no libtorch variables) and with the packages that only the test setup
//! installs hidden from Python, so that a block that needs one of them fails here as it would on
//! a machine where only the main command ran.
//!
//! The blocks write under `runs/` (`runs/gpt`, `runs/licenses-text`, `runs/licenses`), which this
//! test empties first, as a fresh clone has them. The release build they use is `scripts/test.sh`'s
//! (made before the tests run), so the main command's build step finds it done.

use std::path::{Path, PathBuf};
use std::process::Command;

use trainerd_testkit::output::{stdout, text};

/// The distributions only `scripts/setup.sh --tests` installs, by the names they import as.
const TEST_ONLY: [&str; 5] = ["tensorboard", "prometheus_client", "pandas", "PIL", "datasets"];

fn root() -> PathBuf {
    std::fs::canonicalize(Path::new(env!("CARGO_MANIFEST_DIR")).join("..")).unwrap()
}

/// The `sh` blocks of the README's section titled `title`, in order.
fn blocks(readme: &str, title: &str) -> Vec<String> {
    let start = readme.find(&format!("\n## {title}\n")).unwrap_or_else(|| panic!("no section {title:?}"));
    let rest = &readme[start + title.len() + 5..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    section.split("```sh\n").skip(1).map(|b| b[..b.find("```").expect("a closed block")].to_string()).collect()
}

/// A `sitecustomize` that makes the test-only distributions look absent: their names are not
/// found in site-packages (an import fails, `importlib.util.find_spec` says None).
fn hiding(dir: &Path) {
    let names = TEST_ONLY.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ");
    let script = format!(
        r#"import importlib.machinery as m, sys
HIDDEN = {{{names}}}
class _Hiding(m.FileFinder):
    def find_spec(self, name, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, target)
_details = [(m.ExtensionFileLoader, m.EXTENSION_SUFFIXES), (m.SourceFileLoader, m.SOURCE_SUFFIXES),
            (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES)]
_hook = _Hiding.path_hook(*_details)
def _site_only(path):
    if path.endswith("site-packages"):
        return _hook(path)
    raise ImportError
sys.path_hooks.insert(0, _site_only)
sys.path_importer_cache.clear()
"#
    );
    std::fs::write(dir.join("sitecustomize.py"), script).unwrap();
}

/// The environment of a new user's shell: this one's, less what `scripts/env.sh` and the test
/// setup add (the virtualenv on `PATH`, its variables, libtorch's, pyo3's), plus the hiding.
fn user_env(cmd: &mut Command, hide: &Path) {
    let venv = std::env::var("VIRTUAL_ENV").unwrap_or_default();
    let path = std::env::var("PATH").unwrap_or_default();
    let path: Vec<&str> = path.split(':').filter(|p| venv.is_empty() || !p.starts_with(&venv)).collect();
    cmd.env_clear();
    // A user's own settings stay: where caches and toolchains live, how cargo builds.
    let kept = ["HOME", "USER", "LANG", "TERM", "XDG_CACHE_HOME", "TRAINERD_CACHE", "CARGO_HOME", "RUSTUP_HOME"];
    let cargo = ["CARGO_TARGET_DIR", "CARGO_BUILD_JOBS", "RUSTFLAGS", "CARGO_INCREMENTAL"];
    for key in kept.into_iter().chain(cargo) {
        if let Some(v) = std::env::var_os(key) {
            cmd.env(key, v);
        }
    }
    cmd.env("PATH", path.join(":")).env("PYTHONPATH", hide);
}

#[test]
fn the_python_model_quick_start_runs_as_written_after_the_main_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let blocks = blocks(&readme, "Models from PyTorch (Python files)");
    assert!(blocks.len() >= 2, "{blocks:?}");
    assert!(blocks[0].starts_with("EXAMPLE=gpt scripts/train.sh"), "{}", blocks[0]);
    for dir in ["runs/gpt", "runs/licenses-text", "runs/licenses"] {
        let _ = std::fs::remove_dir_all(root().join(dir));
    }
    let hide = tempfile::tempdir().unwrap();
    hiding(hide.path());
    let mut said = String::new();
    for block in &blocks {
        let mut cmd = Command::new("/bin/bash");
        cmd.args(["-euo", "pipefail", "-c", block]).current_dir(root());
        user_env(&mut cmd, hide.path());
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "the README's block failed:\n{block}\n{}", text(&out));
        said.push_str(&stdout(&out));
    }
    // The quick start trained on packed text, and showed perplexity and tokens/s.
    assert!(said.contains("packed into blocks of 128 tokens"), "{said}");
    assert!(said.contains("trainerd: AdamW: weight decay 0.1 on "), "{said}");
    let last_epoch = said.lines().find(|l| l.contains("[worker 0] ") && l.contains("val_perplexity: "));
    let line = last_epoch.unwrap_or_else(|| panic!("no epoch line with a perplexity:\n{said}"));
    assert!(line.contains(" tokens/s"), "{line}");
    assert!(said.contains("loaded "), "{said}");
    for file in ["runs/gpt/predictions.parquet", "runs/gpt/model.safetensors"] {
        assert!(root().join(file).exists(), "{file} is missing:\n{said}");
    }
    // And the hiding hides: a block that imported a test-only package would have failed.
    let mut check = Command::new(root().join("scripts/python"));
    check.args(["-c", "import importlib.util as u; assert u.find_spec('pandas') is None; import pandas"]);
    user_env(&mut check, hide.path());
    let out = check.output().unwrap();
    assert!(!out.status.success() && text(&out).contains("No module named 'pandas'"), "{}", text(&out));
}

#[test]
fn the_keras_quick_start_runs_as_written_after_the_main_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let blocks = blocks(&readme, "Models from Keras");
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    let _ = std::fs::remove_dir_all(root().join("runs/keras"));
    let hide = tempfile::tempdir().unwrap();
    hiding(hide.path());
    let mut cmd = Command::new("/bin/bash");
    cmd.args(["-euo", "pipefail", "-c", &blocks[0]]).current_dir(root());
    user_env(&mut cmd, hide.path());
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "the README's block failed:\n{}\n{}", blocks[0], text(&out));
    let said = stdout(&out);
    assert!(said.contains("trainerd: optimizer from compile(): rmsprop with Keras's update rules"), "{said}");
    // The export, assigned to the Keras model by path, scores what trainerd's test split did.
    let ours = said.lines().find_map(|l| l.split(", test accuracy ").nth(1)).map(|r| r[..6].to_string());
    let theirs = said.lines().find_map(|l| l.strip_prefix("Keras test accuracy of the export: ")).map(str::to_string);
    assert!(ours.is_some() && ours == theirs, "trainerd's {ours:?}, Keras's {theirs:?}:\n{said}");
    assert!(said.contains("done: 468 steps, test loss "), "{said}");
}
