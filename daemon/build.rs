//! Generates the control plane's gRPC code (with a vendored protoc, so no system package is
//! needed) and gives the daemon and its tests an rpath to the libtorch they link.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
    // SAFETY: a build script is single-threaded, so nothing reads the environment concurrently;
    // prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    tonic_prost_build::configure().compile_protos(&["proto/control.proto"], &["proto"])?;
    Ok(())
}
