//! Links the embedded interpreter: the PyTorch virtualenv's base CPython (`libpython3.X.so`) and
//! PyTorch's Python bindings (`libtorch_python.so`, whose tensor conversions `src/shim.cpp`
//! calls), each with an rpath; compiles the shim against the libtorch that torch-sys links; and
//! records where the virtualenv is, for the plugin to find its packages at run time.
use std::path::PathBuf;
use std::process::Command;

/// What the build's Python says about itself: base prefix, library directory and name, include
/// directory, site-packages, version, executable.
const PROBE: &str = "import sys, sysconfig; \
print(sys.base_prefix); print(sysconfig.get_config_var('LIBDIR')); \
print(sysconfig.get_config_var('LDLIBRARY')); print(sysconfig.get_paths()['include']); \
print(sysconfig.get_paths()['purelib']); print('%d.%d' % sys.version_info[:2]); print(sys.executable)";

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=../../sdk/csrc/trainerd_shim.h");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-c", PROBE])
        .output()
        .unwrap_or_else(|e| panic!("running {python} (the PyTorch virtualenv's python; PYO3_PYTHON): {e}"));
    assert!(out.status.success(), "{python} -c ...: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("UTF-8 paths");
    let [home, libdir, ldlibrary, include, site, version, executable] = text.lines().collect::<Vec<_>>()[..] else {
        panic!("unexpected answer from {python}: {text}")
    };
    assert!(
        ldlibrary.ends_with(".so") || ldlibrary.contains(".so."),
        "{python} is not built with a shared libpython ({ldlibrary}): the plugin embeds it, so build \
         Python with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
    );
    let libname = ldlibrary.trim_start_matches("lib").split(".so").next().expect("a library name");
    println!("cargo:rustc-link-search=native={libdir}");
    println!("cargo:rustc-link-lib=dylib={libname}");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    println!("cargo:rustc-env=TRAINERD_PYTHON_HOME={home}");
    println!("cargo:rustc-env=TRAINERD_PYTHON_SITE={site}");
    println!("cargo:rustc-env=TRAINERD_PYTHON_VERSION={version}");
    println!("cargo:rustc-env=TRAINERD_PYTHON_EXECUTABLE={executable}");

    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys says where libtorch is"));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-link-search=native={}", lib.display());
    // `--as-needed` would drop it: nothing but the shim refers to it.
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_python,--as-needed");
    let torch_include = lib.parent().expect("libtorch's lib directory has a parent").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&torch_include)
        .include(torch_include.join("torch/csrc/api/include"))
        .include(include)
        .include("../../sdk/csrc")
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("src/shim.cpp")
        .compile("trainerd_python_shim");
}
