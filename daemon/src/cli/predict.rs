//! `trainerd predict`: a committed checkpoint's outputs for every example of a split, written to
//! Parquet, alone or sharded over the TF_CONFIG cluster, with its summary.

use anyhow::Context;

use super::args::PredictArgs;
use super::stop_flag;
use crate::ops::log::LogFormat;
use crate::ops::progress::Progress;
use crate::sys::accel::CudaLibrary;
use crate::train::jobs::PredictConfig;

/// Runs `trainerd predict`; its exit status.
pub(crate) fn predict(args: PredictArgs, cuda: CudaLibrary, log_format: LogFormat) -> anyhow::Result<i32> {
    let stop = stop_flag()?;
    let (plugin, eval) = super::evaluate::prepare(&args.eval, cuda, args.split)?;
    let cfg = PredictConfig { eval, split: args.split, output: args.output.clone() };
    let mut progress = Progress::stdout(log_format);
    let result = crate::train::predict::run(&plugin, &cfg, &mut progress, &stop)?;
    let split = match args.split {
        trainerd_sdk::Split::Train => "train",
        trainerd_sdk::Split::Test => "test",
    };
    progress.line(&format!(
        "predicted {} {split} examples with checkpoint {} on {} worker(s) in {:.1}s: outputs of shape {:?} each in {}",
        result.examples,
        result.sequence,
        result.workers,
        result.seconds,
        result.shape,
        result.output.display()
    ));
    if let Some(path) = &args.eval.job.summary {
        let json = serde_json::to_string_pretty(&result)? + "\n";
        crate::sys::atomic::write_file(path, &[json.as_bytes()])
            .with_context(|| format!("writing the summary to {}", path.display()))?;
    }
    Ok(0)
}
