//! Compiles the C++ shim (`src/shim.cpp`) against the libtorch that torch-sys links, and gives the
//! library an rpath to it.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    // The C boundary every trainerd shim shares (the SDK's).
    println!("cargo:rerun-if-changed=../../sdk/csrc/trainerd_shim.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys says where libtorch is"));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // The wheel's layout (torch/lib beside torch/include), which a libtorch archive shares.
    let include = lib.parent().expect("libtorch's lib directory has a parent").join("include");
    // Every PyTorch wheel since 2.7 (and the libtorch archives) use the C++11 ABI; torch-sys
    // reads the same variable when it cannot ask Python.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include("../../sdk/csrc")
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("src/shim.cpp")
        .compile("trainerd_torchscript_shim");
}
