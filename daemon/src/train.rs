//! The training loop of one worker: epochs of forward, loss, backward and optimizer steps over
//! the plugin's input pipeline, an evaluation on the test split after each epoch, and the run's
//! summary.
//!
//! Everything that decides the result is fixed by the configuration: libtorch's generator is
//! seeded before the model is built, each epoch's data order comes from (seed, epoch), and the
//! learning rate is a function of the global step. Two runs with the same configuration and
//! thread count give bit-identical parameters.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};
use trainerd_sdk::{InputContext, LrSchedule, OptimizerConfig, Split};

use crate::optim::Optimizer;
use crate::plugin::{CallError, Dataset, ModelInstance, Plugin};
use crate::progress::Progress;
use crate::schedule::lr_at;

/// What to train and how.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Dataset directory, handed to the plugin.
    pub data_dir: PathBuf,
    /// Epochs to run.
    pub epochs: u32,
    /// Per-worker batch size.
    pub batch_size: u32,
    /// Optimizer and hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Seed of the parameters' initialisation and the data order.
    pub seed: u64,
    /// Where the model lives.
    pub device: Device,
    /// Stop each epoch after this many steps (all of them when `None`).
    pub steps_per_epoch: Option<u64>,
    /// libtorch intra-op threads (recorded in the summary; set by the caller).
    pub threads: usize,
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The plugin returned an error or panicked.
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// libtorch failed in the daemon's part of a step.
    #[error("{what}: {source}")]
    Torch {
        /// What the daemon was doing.
        what: &'static str,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// The training split cannot fill a single step.
    #[error(
        "the training split gives no batch: with batch size {batch_size} the input pipeline yields 0 steps per epoch"
    )]
    NoSteps {
        /// Per-worker batch size.
        batch_size: u32,
    },
}

fn torch(what: &'static str) -> impl FnOnce(tch::TchError) -> TrainError {
    move |source| TrainError::Torch { what, source }
}

/// The result of a run, written as JSON by `--summary`.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Plugin name.
    pub plugin: String,
    /// Plugin version.
    pub plugin_version: String,
    /// Workers that trained.
    pub workers: u32,
    /// Epochs run.
    pub epochs: u32,
    /// Optimizer steps taken.
    pub steps: u64,
    /// Examples per step over all workers.
    pub global_batch_size: u64,
    /// Optimizer and hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Run seed.
    pub seed: u64,
    /// Device.
    pub device: String,
    /// libtorch intra-op threads.
    pub threads: usize,
    /// Mean training loss over the last epoch.
    pub final_train_loss: f64,
    /// Mean of each metric over the last training epoch.
    pub final_train_metrics: BTreeMap<String, f64>,
    /// Mean loss on the test split after the last epoch.
    pub test_loss: f64,
    /// Test accuracy after the last epoch, when the plugin reports `accuracy`.
    pub test_accuracy: Option<f64>,
    /// Mean of each metric on the test split.
    pub test_metrics: BTreeMap<String, f64>,
    /// Training examples per second over all epochs (evaluation excluded).
    pub examples_per_second: f64,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// sha256 over every parameter's bytes (native-endian, contiguous), in name order.
    pub params_sha256: String,
}

impl Summary {
    /// Writes the summary as JSON, atomically: a reader (or a restart after a crash) sees the
    /// whole file or none of it.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        use std::io::Write;
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        let mut tmp = tempfile_in(dir, path)?;
        tmp.1.write_all(json.as_bytes())?;
        tmp.1.sync_all()?;
        std::fs::rename(&tmp.0, path)?;
        std::fs::File::open(dir)?.sync_all()
    }
}

/// A new file beside `target`, named after it and this process.
fn tempfile_in(dir: &std::path::Path, target: &std::path::Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
    Ok((tmp, file))
}

/// Running sums over an epoch or an evaluation, kept on the device until read.
struct Totals {
    examples: i64,
    loss: Tensor,
    metrics: Tensor,
}

impl Totals {
    fn new(metrics: usize, device: Device) -> Totals {
        Totals {
            examples: 0,
            loss: Tensor::zeros([], (Kind::Double, device)),
            metrics: Tensor::zeros([metrics as i64], (Kind::Double, device)),
        }
    }

    fn add(&mut self, n: i64, loss: &Tensor, metrics: &Tensor) -> Result<(), TrainError> {
        let _no_grad = tch::no_grad_guard();
        self.examples += n;
        self.loss += loss.f_to_kind(Kind::Double).map_err(torch("loss"))? * n as f64;
        self.metrics += metrics.f_to_kind(Kind::Double).map_err(torch("metrics"))?;
        Ok(())
    }

    /// `(loss, [metric...])` means; waits for the device.
    fn means(&self) -> (f64, Vec<f64>) {
        let n = self.examples.max(1) as f64;
        let metrics = Vec::<f64>::try_from(&self.metrics.to_device(Device::Cpu)).unwrap_or_default();
        (self.loss.double_value(&[]) / n, metrics.into_iter().map(|m| m / n).collect())
    }

    fn named(&self, names: &[String], prefix: &str) -> Vec<(String, f64)> {
        let (loss, metrics) = self.means();
        std::iter::once((format!("{prefix}loss"), loss))
            .chain(names.iter().zip(metrics).map(|(n, m)| (format!("{prefix}{n}"), m)))
            .collect()
    }
}

/// Trains the plugin's model on one worker and evaluates it after each epoch.
pub fn run(plugin: &Plugin, cfg: &RunConfig, progress: &mut Progress) -> Result<Summary, TrainError> {
    let info = plugin.info().clone();
    tch::manual_seed(cfg.seed as i64);
    let model = plugin.create_model("model", cfg.device)?;
    let mut params: Vec<(String, Tensor)> =
        model.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let mut optimizer = Optimizer::new(cfg.optimizer.clone(), &params);
    let train_data = model.load_data(&cfg.data_dir, Split::Train)?;
    let test_data = model.load_data(&cfg.data_dir, Split::Test)?;
    let ctx = |epoch: u32, training: bool| InputContext {
        num_input_pipelines: 1,
        input_pipeline_id: 0,
        per_replica_batch_size: cfg.batch_size,
        training,
        epoch: u64::from(epoch),
        seed: cfg.seed,
    };

    let first = train_data.pipeline(&ctx(0, true))?;
    let steps_per_epoch = cfg.steps_per_epoch.map_or(first.steps(), |s| s.min(first.steps()));
    drop(first);
    if steps_per_epoch == 0 {
        return Err(TrainError::NoSteps { batch_size: cfg.batch_size });
    }
    let total_steps = steps_per_epoch * u64::from(cfg.epochs);

    let mut global_step = 0u64;
    let mut train_time = Duration::ZERO;
    let mut examples = 0i64;
    let mut last_train = Totals::new(info.metrics.len(), cfg.device);
    let mut last_eval = Totals::new(info.metrics.len(), cfg.device);
    for epoch in 0..cfg.epochs {
        progress.epoch_start(epoch, cfg.epochs);
        let mut pipeline = train_data.pipeline(&ctx(epoch, true))?;
        let mut totals = Totals::new(info.metrics.len(), cfg.device);
        let start = Instant::now();
        for step in 1..=steps_per_epoch {
            let Some((xs, labels)) = pipeline.next_batch()? else { break };
            let lr = lr_at(&cfg.schedule, cfg.optimizer.lr(), global_step, total_steps);
            train_step(&model, &mut params, &mut optimizer, lr, cfg.device, (&xs, &labels), &mut totals)?;
            global_step += 1;
            if progress.wants(step, steps_per_epoch) {
                progress.step(step, steps_per_epoch, start.elapsed(), &totals.named(&info.metrics, ""));
            }
        }
        let elapsed = start.elapsed();
        train_time += elapsed;
        examples += totals.examples;
        let eval = evaluate(&model, &test_data, &ctx(epoch, false), cfg.device, info.metrics.len())?;
        let mut values = totals.named(&info.metrics, "");
        values.extend(eval.named(&info.metrics, "val_"));
        let rate = totals.examples as f64 / elapsed.as_secs_f64().max(1e-9);
        progress.epoch_end(steps_per_epoch, elapsed, &values, rate);
        (last_train, last_eval) = (totals, eval);
    }

    let (final_train_loss, train_metrics) = last_train.means();
    let (test_loss, test_metrics) = last_eval.means();
    let named = |values: Vec<f64>| -> BTreeMap<String, f64> { info.metrics.iter().cloned().zip(values).collect() };
    let test_metrics = named(test_metrics);
    Ok(Summary {
        plugin: info.name.clone(),
        plugin_version: info.version.clone(),
        workers: 1,
        epochs: cfg.epochs,
        steps: global_step,
        global_batch_size: u64::from(cfg.batch_size),
        optimizer: cfg.optimizer.clone(),
        schedule: cfg.schedule.clone(),
        seed: cfg.seed,
        device: device_name(cfg.device),
        threads: cfg.threads,
        final_train_loss,
        final_train_metrics: named(train_metrics),
        test_loss,
        test_accuracy: test_metrics.get("accuracy").copied(),
        test_metrics,
        examples_per_second: examples as f64 / train_time.as_secs_f64().max(1e-9),
        train_seconds: train_time.as_secs_f64(),
        params_sha256: params_sha256(&params),
    })
}

/// One synchronous step on a batch `(xs, labels)`: forward, loss, backward, update.
fn train_step(
    model: &ModelInstance<'_>,
    params: &mut [(String, Tensor)],
    optimizer: &mut Optimizer,
    lr: f64,
    device: Device,
    (xs, labels): (&Tensor, &Tensor),
    totals: &mut Totals,
) -> Result<(), TrainError> {
    let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
    let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
    let logits = model.forward(&xs, true)?;
    let loss = model.loss(&logits, &labels)?;
    let metrics = model.metrics(&logits.detach(), &labels)?;
    for (_, p) in params.iter_mut() {
        p.zero_grad();
    }
    loss.f_backward().map_err(torch("backward"))?;
    optimizer.step(params, lr);
    totals.add(xs.size()[0], &loss.detach(), &metrics)
}

/// Mean loss and metrics over one pass of the test split, without gradients.
fn evaluate(
    model: &ModelInstance<'_>,
    data: &Dataset<'_>,
    ctx: &InputContext,
    device: Device,
    metrics: usize,
) -> Result<Totals, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let mut pipeline = data.pipeline(ctx)?;
    let mut totals = Totals::new(metrics, device);
    while let Some((xs, labels)) = pipeline.next_batch()? {
        let n = xs.size()[0];
        if n == 0 {
            continue; // this pipeline's share of the last global batch is empty
        }
        let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let logits = model.forward(&xs, false)?;
        totals.add(n, &model.loss(&logits, &labels)?, &model.metrics(&logits, &labels)?)?;
    }
    Ok(totals)
}

/// `cpu` or `cuda:N`, as `--device` spells it.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// sha256 over every parameter's bytes, in name order.
pub fn params_sha256(params: &[(String, Tensor)]) -> String {
    let mut sorted: Vec<&(String, Tensor)> = params.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hasher = Sha256::new();
    for (_, p) in sorted {
        let p = p.detach().to_device(Device::Cpu).contiguous();
        let numel = p.numel();
        let mut bytes = vec![0u8; numel * p.kind().elt_size_in_bytes()];
        p.copy_data_u8(&mut bytes, numel);
        hasher.update(&bytes);
    }
    format!("{:x}", hasher.finalize())
}
