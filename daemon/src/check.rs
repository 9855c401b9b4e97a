//! `trainerd plugin check`: load a plugin in a child process and print its identity, so that a
//! plugin that crashes while loading takes down only the child, and the checker names the
//! signal.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;

use tch::Device;

use crate::accel::Facts;
use crate::plugin::{CallError, Plugin};
use crate::supervise::signal_name;

/// A human-readable description of a loaded plugin, and of the libtorch it would train on.
/// Builds one model on the CPU to count its parameters, which also proves that construction
/// works.
pub fn describe(plugin: &Plugin, torch: &Facts) -> Result<String, CallError> {
    let info = plugin.info();
    let facts = plugin.facts();
    let model = plugin.create_model("model", Device::Cpu)?;
    let values: i64 = model.parameters().iter().map(|(_, t)| t.numel() as i64).sum();
    let names: Vec<&str> = model.parameters().iter().map(|(n, _)| n.as_str()).collect();
    let d = &info.defaults;
    Ok(format!(
        "plugin: {path}\n\
         name: {name} {version}\n\
         description: {description}\n\
         built with: abi {abi}, trainerd-sdk {sdk}, tch {tch}, libtorch {libtorch}, {target}, panic={panic}\n\
         metrics: {metrics}\n\
         defaults: {epochs} epochs, batch size {batch}, optimizer {optimizer}\n\
         parameters: {count} tensors, {values} values ({names})\n\
         this trainerd: {torch}",
        path = plugin.path().display(),
        name = info.name,
        version = info.version,
        description = info.description,
        abi = facts.abi_version,
        sdk = facts.sdk_version,
        tch = facts.tch_version,
        libtorch = facts.libtorch_version,
        target = facts.target,
        panic = facts.panic_strategy,
        metrics = info.metrics.join(", "),
        epochs = d.epochs,
        batch = d.batch_size,
        optimizer = serde_json::to_string(&d.optimizer).unwrap_or_default(),
        count = names.len(),
        values = crate::progress::thousands(values as f64),
        names = names.join(", "),
        torch = torch.line(),
    ))
}

/// Runs `trainerd plugin check --in-process PATH` in a child process and reports how it ended.
/// Returns the exit code for this process.
pub fn check_in_child(path: &Path) -> std::io::Result<i32> {
    let exe = std::env::current_exe()?;
    let status = Command::new(exe).args(["plugin", "check", "--in-process"]).arg(path).status()?;
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
