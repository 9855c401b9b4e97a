//! The flags of a `trainerd run`, built in one place: a plugin of the workspace on the test
//! dataset, and what a test sets beside them. Every test that starts a run (alone, as a
//! cluster's worker, under `trainerd local`) or an evaluation, which takes the same flags, builds
//! them here, so that a flag renamed is renamed once.
//!
//! ```no_run
//! use trainerd_testkit::RunArgs;
//! let out = RunArgs::new("linear").threads(1).epochs(1).summary("s.json").command("run").output().unwrap();
//! ```

use std::ffi::OsStr;
use std::process::Command;

use crate::paths::{dataset, plugin, trainerd_cmd};

/// The flags of one `trainerd run` (or `evaluate`, or the workers of a `trainerd local`), in the
/// order they were set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunArgs {
    args: Vec<String>,
}

fn text(path: impl AsRef<OsStr>) -> String {
    path.as_ref().to_str().expect("a path of UTF-8").to_string()
}

impl RunArgs {
    /// The workspace's plugin `name` (its crate's name) on the test dataset.
    pub fn new(name: &str) -> RunArgs {
        RunArgs::with_plugin(plugin(name))
    }

    /// The plugin library at `path` on the test dataset.
    pub fn with_plugin(path: impl AsRef<OsStr>) -> RunArgs {
        RunArgs::default().set("--plugin", text(path)).set("--data", text(dataset()))
    }

    /// `--flag value`; a flag given before (`--data`, by `new`) takes the new value in its place.
    pub fn set(mut self, flag: &str, value: impl ToString) -> RunArgs {
        let value = value.to_string();
        match self.args.iter().position(|a| a == flag) {
            Some(at) if at + 1 < self.args.len() => self.args[at + 1] = value,
            _ => self.args.extend([flag.to_string(), value]),
        }
        self
    }

    /// A `--plugin-arg KEY=VALUE`, after those given before (the flag repeats).
    pub fn plugin_arg(mut self, key_value: impl ToString) -> RunArgs {
        self.args.extend(["--plugin-arg".to_string(), key_value.to_string()]);
        self
    }

    /// A switch: `--flag` with no value (`--no-evaluation`, `--nesterov`).
    pub fn on(mut self, flag: &str) -> RunArgs {
        self.args.push(flag.to_string());
        self
    }

    /// Flags as written (`["--precision", "bf16"]`), after those set so far.
    pub fn extend<S: AsRef<str>>(mut self, flags: &[S]) -> RunArgs {
        self.args.extend(flags.iter().map(|f| f.as_ref().to_string()));
        self
    }

    /// The data: a directory, or `s3://bucket/prefix`.
    pub fn data(self, data: impl AsRef<OsStr>) -> RunArgs {
        self.set("--data", text(data))
    }

    /// libtorch's thread count.
    pub fn threads(self, n: usize) -> RunArgs {
        self.set("--threads", n)
    }

    /// Epochs.
    pub fn epochs(self, n: u32) -> RunArgs {
        self.set("--epochs", n)
    }

    /// Steps of each epoch.
    pub fn steps(self, n: u64) -> RunArgs {
        self.set("--steps-per-epoch", n)
    }

    /// The seed.
    pub fn seed(self, n: u64) -> RunArgs {
        self.set("--seed", n)
    }

    /// The per-worker batch size.
    pub fn batch(self, n: u32) -> RunArgs {
        self.set("--batch-size", n)
    }

    /// The optimizer and its learning rate.
    pub fn optimizer(self, name: &str, lr: f64) -> RunArgs {
        self.set("--optimizer", name).set("--lr", lr)
    }

    /// Where the summary goes (`{rank}` in it becomes a cluster worker's index).
    pub fn summary(self, path: impl AsRef<OsStr>) -> RunArgs {
        self.set("--summary", text(path))
    }

    /// Commits to `dir` (a directory or `s3://...`) every `every` steps (0: at epoch ends only).
    pub fn checkpoints(self, dir: impl AsRef<OsStr>, every: u64) -> RunArgs {
        let run = self.set("--checkpoint-dir", text(dir));
        if every == 0 {
            return run;
        }
        run.set("--checkpoint-every", every)
    }

    /// The flags.
    pub fn to_vec(&self) -> Vec<String> {
        self.args.clone()
    }

    /// The flags, borrowed (for [`crate::Worker::start`]'s argument list).
    pub fn strs(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// The workspace's `trainerd` with `sub` (`run`, `evaluate`) and these flags.
    pub fn command(&self, sub: &str) -> Command {
        let mut cmd = trainerd_cmd();
        cmd.arg(sub).args(&self.args);
        cmd
    }

    /// `trainerd local --workers N` of these flags.
    pub fn local(&self, workers: usize) -> Command {
        let mut cmd = trainerd_cmd();
        cmd.args(["local", "--workers", &workers.to_string()]).args(&self.args);
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_set_again_takes_its_new_value_in_place() {
        let a = RunArgs::default().set("--plugin", "p.so").set("--data", "/d").threads(1).data("s3://b/x").epochs(2);
        assert_eq!(a.to_vec(), ["--plugin", "p.so", "--data", "s3://b/x", "--threads", "1", "--epochs", "2"]);
        let a = a.checkpoints("/c", 0).checkpoints("/c", 40).on("--no-evaluation").extend(&["--seed", "3"]);
        assert_eq!(
            a.strs()[8..],
            ["--checkpoint-dir", "/c", "--checkpoint-every", "40", "--no-evaluation", "--seed", "3"]
        );
    }
}
