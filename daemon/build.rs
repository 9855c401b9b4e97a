//! Generates the control plane's gRPC code (with a vendored protoc, so no system package is
//! needed), compiles the autocast, CPU-capability and gradient-hook shims (`csrc/`) against the libtorch that torch-sys
//! links, and gives the daemon and its tests an rpath to that libtorch.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/control.proto");
    println!("cargo:rerun-if-changed=csrc/autocast.cpp");
    println!("cargo:rerun-if-changed=csrc/cpu.cpp");
    println!("cargo:rerun-if-changed=csrc/grad_ready.cpp");
    println!("cargo:rerun-if-changed=../sdk/csrc/trainerd_shim.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = std::path::PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB")?);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // The wheel's layout (torch/lib beside torch/include), which a libtorch archive shares; every
    // wheel since PyTorch 2.7 uses the C++11 ABI (torch-sys reads the same variable).
    let include = lib.parent().ok_or("libtorch's lib directory has no parent")?.join("include");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include("../sdk/csrc")
        .flag("-std=c++17")
        .flag(format!(
            "-D_GLIBCXX_USE_CXX11_ABI={}",
            std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into())
        ))
        .file("csrc/autocast.cpp")
        .file("csrc/cpu.cpp")
        .file("csrc/grad_ready.cpp")
        .compile("trainerd_autocast");
    // SAFETY: a build script is single-threaded, so nothing reads the environment concurrently;
    // prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    // A catch-up's pieces are slices of one buffer (`bytes::Bytes`), not copies.
    tonic_prost_build::configure()
        .bytes(".trainerd.control.v1.CatchUpPart.data")
        .compile_protos(&["proto/control.proto"], &["proto"])?;
    Ok(())
}
