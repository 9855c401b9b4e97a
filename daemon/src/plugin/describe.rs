//! What `trainerd plugin check` prints of a loaded plugin: its identity, its model's variables,
//! the arguments it takes, and the libtorch it would train on.

use tch::Device;

use crate::plugin::{CallError, Plugin};
use crate::sys::accel::Facts;
use trainerd_sdk::{ArgSpec, PluginArgs};

/// A human-readable description of a loaded plugin, and of the libtorch it would train on.
/// Builds one model on the CPU to count its parameters, which also proves that construction
/// works.
pub(crate) fn describe(plugin: &Plugin, torch: &Facts) -> Result<String, CallError> {
    let info = plugin.info();
    let facts = plugin.facts();
    let model = plugin.create_model(crate::plugin::MODEL_PATH, Device::Cpu)?;
    let (params, buffers) = model.split_variables();
    let values: i64 = params.iter().map(|(_, t)| t.numel() as i64).sum();
    let shapes = |named: &[(String, tch::Tensor)]| {
        named.iter().map(|(n, t)| format!("{n} {:?}", t.size())).collect::<Vec<_>>().join(", ")
    };
    let d = &info.defaults;
    let identity: Vec<String> = info.identity.iter().map(|(k, v)| format!("\n  {k}: {v}")).collect();
    Ok(format!(
        "plugin: {path}\n\
         name: {name} {version}\n\
         description: {description}\n\
         built with: abi {abi}, trainerd-sdk {sdk}, tch {tch}, libtorch {libtorch}, {target}, panic={panic}\n\
         metrics: {metrics}\n\
         defaults: {epochs} epochs, batch size {batch}, optimizer {optimizer}\n\
         parameters: {count} tensors, {values} values ({names})\n\
         buffers: {buffers}\n\
         {arguments}{identity}\n\
         this trainerd: {torch}",
        arguments = arguments(plugin.arguments(), plugin.args()),
        identity = if identity.is_empty() { String::new() } else { format!("\nidentity:{}", identity.concat()) },
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
        optimizer = match &d.optimizer {
            trainerd_sdk::OptimizerConfig::Keras(k) => {
                format!("{} with Keras's update rules ({}; from compile())", k.name(), k.describe())
            }
            other => serde_json::to_string(other).unwrap_or_default(),
        },
        count = params.len(),
        values = crate::ops::progress::thousands(values as f64),
        names = shapes(&params),
        buffers = if buffers.is_empty() {
            "none".into()
        } else {
            format!("{} tensors ({})", buffers.len(), shapes(&buffers))
        },
        torch = torch.line(),
    ))
}

/// The keys a plugin accepts, one per line, with the value given (`= VALUE`) where one is.
pub(crate) fn arguments(specs: &[ArgSpec], given: &PluginArgs) -> String {
    if specs.is_empty() {
        return "arguments: none".into();
    }
    let lines: Vec<String> = trainerd_sdk::args::describe(specs)
        .into_iter()
        .zip(specs)
        .map(|(line, spec)| match given.get(&spec.key) {
            Some(value) => format!("\n  {line} = {value}"),
            None => format!("\n  {line}"),
        })
        .collect();
    format!("arguments (--plugin-arg KEY=VALUE):{}", lines.concat())
}
