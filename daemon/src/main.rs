//! The `trainerd` command line (the library's [`trainerd::cli`] does the work).

fn main() -> std::process::ExitCode {
    trainerd::cli::main()
}
