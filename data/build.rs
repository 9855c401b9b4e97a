//! Gives this crate's test binaries an rpath to the libtorch they link (through the SDK).
fn main() {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
