//! Records the build facts that a plugin's header carries (target, libtorch version) and gives
//! this crate's test binaries an rpath to libtorch.
use std::path::Path;

fn main() {
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    println!("cargo:rustc-env=TRAINERD_BUILD_TARGET={target}");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB").unwrap_or_default();
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if !lib.is_empty() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
    println!("cargo:rustc-env=TRAINERD_LIBTORCH_VERSION={}", libtorch_version(Path::new(&lib)));
}

/// The version of the libtorch this build links: the wheel's `torch/version.py` when built from a
/// PyTorch install, else the `build-version` file of a libtorch archive.
fn libtorch_version(lib: &Path) -> String {
    let Some(root) = lib.parent() else { return "unknown".into() };
    let version_py = root.join("version.py");
    if let Ok(text) = std::fs::read_to_string(&version_py) {
        println!("cargo:rerun-if-changed={}", version_py.display());
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("__version__") {
                if let Some(v) = rest.split(['\'', '"']).nth(1) {
                    return v.to_string();
                }
            }
        }
    }
    let build_version = root.join("build-version");
    if let Ok(text) = std::fs::read_to_string(&build_version) {
        println!("cargo:rerun-if-changed={}", build_version.display());
        return text.trim().to_string();
    }
    "unknown".into()
}
