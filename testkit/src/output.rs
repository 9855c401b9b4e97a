//! Reading what a finished command printed, and the files it wrote.

use std::path::Path;
use std::process::Output;

/// Standard output and error, for assertion messages.
pub fn text(out: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Standard output.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Standard error.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `error: ...` line a run printed.
pub fn error_line(out: &Output) -> String {
    stderr(out)
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line; {}", text(out)))
        .to_string()
}

/// The error line of a run that failed with exit status 1 (an error, not a crash).
pub fn error_of(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{}", text(out));
    error_line(out)
}

/// The lines of a `--metrics-log` file, one JSON object a step.
pub fn metrics_log(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display()))).collect()
}

/// Each step's global loss from a `--metrics-log` file.
pub fn step_losses(path: &Path) -> Vec<f64> {
    metrics_log(path).iter().map(|l| l["loss"].as_f64().expect("a loss in every line")).collect()
}

/// A JSON file (a summary).
pub fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `params_sha256` from a summary file.
pub fn params_sha256(summary: &Path) -> String {
    json(summary)["params_sha256"].as_str().expect("params_sha256").to_string()
}
