//! `trainerd evaluate`: a committed checkpoint's loss and metrics on the test split, alone or
//! sharded over the TF_CONFIG cluster, with its summary; and what it shares with `predict`.

use anyhow::Context;

use super::args::EvalArgs;
use std::sync::Arc;

use super::{data_options, device, set_threads, stop_flag};
use crate::input::DataSource;
use crate::ops::log::LogFormat;
use crate::ops::progress::Progress;
use crate::plugin::Plugin;
use crate::sys::accel::{self, CudaLibrary};
use crate::train::jobs::EvalConfig;
use trainerd_sdk::Split;

/// Runs `trainerd evaluate`; its exit status.
pub(crate) fn evaluate(args: EvalArgs, cuda: CudaLibrary, log_format: LogFormat) -> anyhow::Result<i32> {
    let stop = stop_flag()?;
    let (plugin, cfg) = prepare(&args, cuda, Split::Test)?;
    let mut progress = Progress::stdout(log_format);
    let result = crate::train::evaluate::run(&plugin, &cfg, &mut progress, &stop)?;
    progress.line(&format!(
        "evaluated checkpoint {} ({} test examples on {} worker(s)): test loss {:.4}{}, params sha256 {}",
        result.sequence,
        result.examples,
        result.workers,
        result.test_loss,
        result.test_accuracy.map(|a| format!(", test accuracy {a:.4}")).unwrap_or_default(),
        result.params_sha256
    ));
    if let Some(path) = &args.job.summary {
        let json = serde_json::to_string_pretty(&result)? + "\n";
        crate::sys::atomic::write_file(path, &[json.as_bytes()])
            .with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    Ok(0)
}

/// The plugin and the configuration of a pass over `split` by a committed checkpoint
/// (`evaluate`, `predict`).
pub(super) fn prepare(args: &EvalArgs, cuda: CudaLibrary, split: Split) -> anyhow::Result<(Plugin, EvalConfig)> {
    let timeouts = super::timeouts(&args.job, &super::args::TimeoutArgs::default())?;
    let (cluster, network) = args.job.cluster.plan()?;
    let facts = accel::facts(cuda);
    let device = device(&args.job.device, &facts)?;
    let threads = set_threads(args.job.threads)?;
    let plugin = Plugin::load(&args.job.plugin, &args.job.plugin_args.parse()?)?;
    let options = data_options(&args.job.data, &args.job.s3, Arc::new(trainerd_data::Quiet), timeouts.data)?;
    // Evaluation reads the test split in file order: the window plays no part.
    let opening = (options, &args.job.data.text_options());
    let say = &mut |line: &str| println!("{line}");
    let data = DataSource::open(&args.job.data.data, plugin.info(), (u64::MAX, split == Split::Test), opening, say)?;
    let sequence = match args.best {
        true => Some(crate::checkpoint::inspect::best(&super::ckpt::open_store(&args.checkpoint, &args.job.s3)?)?),
        false => args.sequence,
    };
    args.job.precision.check(device)?;
    let cfg = EvalConfig {
        data,
        plugin: plugin.agreement(),
        precision: args.job.precision,
        location: args.checkpoint.parse()?,
        s3: args.job.s3.options(),
        sequence,
        batch_size: args.job.batch_size.unwrap_or(plugin.info().defaults.batch_size),
        device,
        threads,
        cluster,
        network,
        timeouts,
    };
    if cfg.batch_size == 0 {
        anyhow::bail!("--batch-size 0: expected at least 1");
    }
    Ok((plugin, cfg))
}
