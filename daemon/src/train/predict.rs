//! `trainerd predict`: a committed checkpoint's outputs for every example of a dataset split, as
//! Keras's `model.predict` and the Estimator's PREDICT mode, written to Parquet
//! ([`trainerd_data::predictions`]). Alone, or sharded over a TF_CONFIG cluster as `trainerd
//! evaluate` is: the checkpoint reaches every member the same way, each member predicts its share
//! of every batch and writes its own file (`NAME-0000r-of-0000n.parquet`), and the files together
//! hold every example once.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};
use trainerd_data::predictions::Writer;
use trainerd_sdk::{InputContext, Split};

use super::error::TrainError;
use super::evaluate::{failed, load, Loaded};
use super::jobs::PredictConfig;
use super::step::{on_device, torch};
use crate::cluster::coordinator::rules::FINAL_BARRIER;
use crate::input::Data;
use crate::ops::progress::Progress;
use crate::plugin::{ModelInstance, Plugin};
use crate::train::agreement::Job;
use crate::train::batches::input_context;
use crate::train::summary::device_name;

/// The result, written as JSON by `--summary`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Prediction {
    /// Plugin name.
    pub(crate) plugin: String,
    /// The checkpoint location.
    pub(crate) checkpoint: String,
    /// The commit.
    pub(crate) sequence: u64,
    /// Its global step.
    pub(crate) global_step: u64,
    /// The split predicted.
    pub(crate) split: Split,
    /// The file this member wrote.
    pub(crate) output: PathBuf,
    /// Examples in it.
    pub(crate) examples: u64,
    /// One example's output shape.
    pub(crate) shape: Vec<i64>,
    /// Workers that predicted.
    pub(crate) workers: usize,
    /// Seconds the pass took.
    pub(crate) seconds: f64,
    /// Device.
    pub(crate) device: String,
    /// sha256 over the model's variables, as a training summary's `params_sha256`.
    pub(crate) params_sha256: String,
}

/// Member `rank`'s file of `world`: `output` alone, else `NAME-0000r-of-0000n.EXT` beside it.
pub(crate) fn member_file(output: &Path, (rank, world): (usize, usize)) -> PathBuf {
    if world == 1 {
        return output.to_path_buf();
    }
    let stem = output.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = output.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    output.with_file_name(format!("{stem}-{rank:05}-of-{world:05}{ext}"))
}

/// One batch's outputs as float32 on the host, row-major, and one example's shape.
fn host_outputs(out: &Tensor, examples: i64) -> Result<(Vec<f32>, Vec<i64>), TrainError> {
    let size = out.size();
    if size.first() != Some(&examples) {
        return Err(TrainError::Predict(format!(
            "the plugin's predict returned a tensor of shape {size:?} for a batch of {examples} examples: expected \
             the examples along its first dimension"
        )));
    }
    let flat = out
        .f_to_device(Device::Cpu)
        .and_then(|t| t.f_to_kind(Kind::Float))
        .and_then(|t| t.f_contiguous())
        .and_then(|t| t.f_reshape([-1]))
        .map_err(torch("reading the outputs"))?;
    Ok((Vec::<f32>::try_from(&flat).map_err(torch("reading the outputs"))?, size[1..].to_vec()))
}

/// Predicts every example of the split; `stop` ends a wait for the cluster.
pub(crate) fn run(
    plugin: &Plugin,
    cfg: &PredictConfig,
    progress: &mut Progress,
    stop: &AtomicBool,
) -> Result<Prediction, TrainError> {
    let e = &cfg.eval;
    let Loaded { session, model, state, sequence } = load(plugin, (e, Job::Prediction(cfg)), progress, stop)?;
    let (rank, world) = (session.rank(), session.world());
    let data = Data::load(&e.data, &model)?;
    let ctx = input_context((rank, world), e.batch_size, (false, u64::from(state.position.epoch), 0));
    let output = member_file(&cfg.output, (rank, world));
    let began = Instant::now();
    let (examples, shape) = write(&model, (&data, &ctx), cfg, &output, progress)?;
    if world > 1 {
        session.barrier(FINAL_BARRIER).map_err(failed)?;
        session.finish();
    }
    Ok(Prediction {
        plugin: plugin.info().name.clone(),
        checkpoint: e.location.to_string(),
        sequence,
        global_step: state.position.global_step,
        split: cfg.split,
        output,
        examples,
        shape,
        workers: world,
        seconds: began.elapsed().as_secs_f64(),
        device: device_name(e.device),
        params_sha256: state.params_sha256(),
    })
}

/// Every batch of `ctx`'s share of the split through the model's `predict`, written to `output`:
/// (examples, one example's shape).
fn write(
    model: &ModelInstance<'_>,
    (data, ctx): (&Data<'_>, &InputContext),
    cfg: &PredictConfig,
    output: &Path,
    progress: &mut Progress,
) -> Result<(u64, Vec<i64>), TrainError> {
    let e = &cfg.eval;
    let began = Instant::now();
    let (mut batches, steps) = data.in_order(ctx, cfg.split)?;
    let _no_grad = tch::no_grad_guard();
    let _autocast = e.precision.autocast(e.device).map_err(torch("entering autocast"))?;
    let mut writer: Option<Writer> = None;
    let written = |source| TrainError::Predictions { path: output.to_path_buf(), source };
    let mut step = 0u64;
    while let Some(batch) = batches.next_batch()? {
        step += 1;
        let n = batch.columns.examples();
        if n == 0 {
            continue; // this member's share of the last global batch is empty
        }
        let ids = data.example_numbers(&batch, ctx, cfg.split)?;
        let columns = on_device(&batch.columns, e.device)?;
        let (values, shape) = host_outputs(&model.predict(&columns)?, n)?;
        let w = match &mut writer {
            Some(w) => w,
            None => writer.insert(Writer::create(output, &shape).map_err(written)?),
        };
        if w.shape() != shape.as_slice() {
            return Err(TrainError::Predict(format!(
                "the plugin's predict returned outputs of shape {shape:?} per example at batch {step}, {:?} before",
                w.shape()
            )));
        }
        w.write(&ids, values).map_err(written)?;
        if progress.wants(step, steps) {
            progress.step(step, steps, began.elapsed(), &[]);
        }
    }
    let writer = match writer {
        Some(w) => w,
        None => Writer::create(output, &[]).map_err(written)?,
    };
    let shape = writer.shape().to_vec();
    Ok((writer.finish().map_err(written)?, shape))
}
