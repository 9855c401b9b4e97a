//! Gives this library an rpath to the libtorch it links, so it loads without LD_LIBRARY_PATH.
fn main() {
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
