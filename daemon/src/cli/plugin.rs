//! `trainerd plugin check PATH`: loads a plugin in a child process and prints its identity
//! ([`crate::plugin::describe`]), so that a plugin that crashes while loading takes down only the
//! child, and the checker names the signal.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use trainerd_sdk::PluginArgs;

use super::args::{PluginArgFlags, PluginCommand};
use crate::plugin::describe::{arguments, describe};
use crate::plugin::{LoadError, Plugin};
use crate::supervise::signal_name;
use crate::sys::accel::{self, CudaLibrary};

/// Runs `trainerd plugin ...`; its exit status.
pub(crate) fn run(command: PluginCommand, cuda: CudaLibrary) -> anyhow::Result<i32> {
    let PluginCommand::Check { path, args, in_process } = command;
    let args = args.parse()?;
    if !in_process {
        return check_in_child(&path, &args).context("running the plugin check");
    }
    check(&path, &args, cuda)
}

/// The check itself, in this process (the child's part).
fn check(path: &Path, args: &PluginArgs, cuda: CudaLibrary) -> anyhow::Result<i32> {
    let facts = accel::facts(cuda);
    let plugin = match Plugin::load(path, args) {
        Ok(plugin) => plugin,
        Err(refused @ (LoadError::Refused { .. } | LoadError::Arguments { .. })) => {
            let specs = Plugin::accepted(path)?;
            anyhow::bail!("{refused}\n{}", arguments(&specs, args));
        }
        Err(other) => return Err(other.into()),
    };
    let text = describe(&plugin, &facts)?;
    println!("{text}");
    Ok(0)
}

/// Runs `trainerd plugin check --in-process PATH` in a child process and reports how it ended.
/// Returns the exit code for this process.
fn check_in_child(path: &Path, args: &PluginArgs) -> std::io::Result<i32> {
    let exe = std::env::current_exe()?;
    let status = Command::new(exe)
        .args(["plugin", "check", "--in-process"])
        .args(PluginArgFlags::to_flags(args))
        .arg(path)
        .status()?;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => {
            eprintln!(
                "error: plugin {}: the plugin crashed the checking process with signal {signal} ({}) while loading",
                path.display(),
                signal_name(signal)
            );
            128 + signal
        }
        (None, None) => 1,
    })
}
