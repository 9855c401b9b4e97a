//! The training loop: synchronous data parallelism over the ring (a ring of one when there is
//! no cluster). Every worker computes gradients on its slice of each global batch, the ring
//! averages them, and every worker applies the same update, so the replicas stay identical.
//! Each epoch ends with an evaluation on the test split, each worker evaluating its shard, the
//! totals summed over the ring.
//!
//! Everything that decides the result is fixed by the configuration: libtorch's generator is
//! seeded before the model is built (and the chief's initial parameters are broadcast), each
//! epoch's data order comes from (seed, epoch), the all-reduce adds in a fixed order, and the
//! learning rate is a function of the global step. The same configuration and thread count give
//! bit-identical parameters.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};
use trainerd_sdk::{InputContext, LrSchedule, OptimizerConfig, Split};

use trainerd_storage::{Location, Restored, S3Options};

use crate::checkpoint::{self, Checkpointer, Meta, Position};
use crate::cluster::control::{self, ClusterError, ControlPlane, Identity, Timeouts};
use crate::cluster::ClusterConfig;
use crate::collective::buckets::{self, Buckets};
use crate::collective::{CollectiveError, ReduceOp, Ring};
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
    /// The cluster, or `None` for one worker.
    pub cluster: Option<ClusterConfig>,
    /// Rendezvous and barrier deadlines.
    pub timeouts: Timeouts,
    /// Deadline of one collective: a peer silent for longer is an error, never a hang.
    pub collective_timeout: Duration,
    /// Gradient bucket size in bytes.
    pub bucket_bytes: usize,
    /// Append one JSON line per step (global loss, metrics, learning rate) to this file.
    pub metrics_log: Option<PathBuf>,
    /// Checkpoints, if any.
    pub checkpoint: Option<CheckpointConfig>,
}

impl RunConfig {
    /// What every worker must agree on, as canonical JSON.
    fn agreement_json(&self) -> String {
        serde_json::json!({
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "schedule": self.schedule,
            "seed": self.seed,
            "steps_per_epoch": self.steps_per_epoch,
            "bucket_bytes": self.bucket_bytes,
        })
        .to_string()
    }
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
        "the training split gives no batch: with batch size {batch_size} per worker and {workers} worker(s) the \
         input pipeline yields 0 steps per epoch"
    )]
    NoSteps {
        /// Per-worker batch size.
        batch_size: u32,
        /// Workers.
        workers: usize,
    },
    /// Cluster membership failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A collective failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Checkpointing failed (opening the location, a checkpoint that does not fit this run).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A local file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
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
    pub workers: usize,
    /// This worker's rank.
    pub rank: usize,
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
    /// Mean training loss over the last epoch, over all workers.
    pub final_train_loss: f64,
    /// Mean of each metric over the last training epoch, over all workers.
    pub final_train_metrics: BTreeMap<String, f64>,
    /// Mean loss on the test split after the last epoch.
    pub test_loss: f64,
    /// Test accuracy after the last epoch, when the plugin reports `accuracy`.
    pub test_accuracy: Option<f64>,
    /// Mean of each metric on the test split.
    pub test_metrics: BTreeMap<String, f64>,
    /// Training examples per second over all workers and epochs (evaluation excluded).
    pub examples_per_second: f64,
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// sha256 over every parameter's bytes (native-endian, contiguous), in name order.
    pub params_sha256: String,
    /// Why the last checkpoint commit failed, if it did (the run's result is then not durable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_error: Option<String>,
}

impl Summary {
    /// Writes the summary as JSON, atomically: a reader (or a restart after a crash) sees the
    /// whole file or none of it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n";
        crate::atomic::write_file(path, &[json.as_bytes()])
    }
}

/// Global sums over an epoch or an evaluation: examples, loss × examples, metric sums.
#[derive(Clone, Debug, Default)]
struct Totals {
    examples: f64,
    loss: f64,
    metrics: Vec<f64>,
}

impl Totals {
    fn new(metrics: usize) -> Totals {
        Totals { metrics: vec![0.0; metrics], ..Default::default() }
    }

    /// Totals from sums laid out as [`Totals::sums`] (zeros if empty).
    fn from_sums(sums: &[f64], metrics: usize) -> Totals {
        let mut t = Totals::new(metrics);
        if sums.len() == 2 + metrics {
            t.add(sums);
        }
        t
    }

    /// `[loss × n, n, metric...]`.
    fn sums(&self) -> Vec<f64> {
        let mut v = vec![self.loss, self.examples];
        v.extend(&self.metrics);
        v
    }

    /// Adds one step's sums, laid out as `[loss × n, n, metric...]`.
    fn add(&mut self, sums: &[f64]) {
        self.loss += sums[0];
        self.examples += sums[1];
        self.metrics.iter_mut().zip(&sums[2..]).for_each(|(m, s)| *m += s);
    }

    fn loss_mean(&self) -> f64 {
        self.loss / self.examples.max(1.0)
    }

    fn metric_means(&self) -> Vec<f64> {
        self.metrics.iter().map(|m| m / self.examples.max(1.0)).collect()
    }

    fn named(&self, names: &[String], prefix: &str) -> Vec<(String, f64)> {
        std::iter::once((format!("{prefix}loss"), self.loss_mean()))
            .chain(names.iter().zip(self.metric_means()).map(|(n, m)| (format!("{prefix}{n}"), m)))
            .collect()
    }
}

/// One step's `[loss × n, n, metric...]` from the plugin's outputs.
fn step_sums(n: i64, loss: &Tensor, metrics: &Tensor) -> Result<Vec<f64>, TrainError> {
    let loss = loss.f_double_value(&[]).map_err(torch("reading the loss"))?;
    let metrics = Vec::<f64>::try_from(
        metrics.f_to_device(Device::Cpu).and_then(|m| m.f_to_kind(Kind::Double)).map_err(torch("reading metrics"))?,
    )
    .map_err(torch("reading metrics"))?;
    let mut sums = vec![loss * n as f64, n as f64];
    sums.extend(metrics);
    Ok(sums)
}

/// The cluster side of a run: the control plane (kept alive for barriers and heartbeats) and
/// the ring.
struct Membership {
    plane: Option<ControlPlane>,
    ring: Ring,
}

/// Serves the control plane, rendezvouses with every member, and forms the ring.
fn join_cluster(plugin: &Plugin, cfg: &RunConfig, progress: &mut Progress) -> Result<Membership, TrainError> {
    let Some(cluster) = &cfg.cluster else {
        return Ok(Membership { plane: None, ring: Ring::single() });
    };
    let identity = Identity {
        cluster_json: cluster.cluster_json(),
        plugin: plugin_identity(plugin),
        run_config_json: cfg.agreement_json(),
    };
    let mut plane = ControlPlane::start(cluster, identity.clone(), cfg.timeouts)?;
    let me = cluster.me();
    let name = plane.names()[cluster.rank].clone();
    let ip = control::resolve(&me.address)
        .map_err(|reason| ClusterError::Bind { address: me.address.clone(), member: name.clone(), reason })?
        .ip();
    let listener = TcpListener::bind((ip, 0)).map_err(|e| ClusterError::Bind {
        address: format!("{ip}:0"),
        member: name.clone(),
        reason: format!("data-plane listener: {e}"),
    })?;
    let data_port = listener.local_addr().map_err(|e| ClusterError::Other(e.to_string()))?.port();
    let host = me.address.rsplit_once(':').map_or(me.address.as_str(), |(h, _)| h);
    if cluster.rank == 0 {
        progress.line(&format!("trainerd: waiting for {} worker(s) to join", cluster.world_size()));
    }
    let membership = plane.rendezvous(&identity, format!("{host}:{data_port}"))?;
    let world = cluster.world_size();
    let next = &membership.data_addresses[(cluster.rank + 1) % world];
    let next_addr = control::resolve(next).map_err(|e| ClusterError::Other(format!("data address {next}: {e}")))?;
    let ring =
        Ring::connect(cluster.rank, plane.names(), listener, next_addr, membership.generation, cfg.collective_timeout)?;
    if cluster.rank == 0 {
        progress.line(&format!("trainerd: {world} worker(s) joined (generation {})", membership.generation));
    }
    Ok(Membership { plane: Some(plane), ring })
}

/// What must match on every worker about the plugin.
fn plugin_identity(plugin: &Plugin) -> String {
    let (i, f) = (plugin.info(), plugin.facts());
    format!(
        "{} {} (trainerd-sdk {}, tch {}, libtorch {}, {})",
        i.name, i.version, f.sdk_version, f.tch_version, f.libtorch_version, f.target
    )
}

/// Checkpointing settings.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// Where.
    pub location: Location,
    /// S3 settings beyond the AWS variables.
    pub s3: S3Options,
    /// Commit every this many steps (0: only at each epoch's end).
    pub every: u64,
    /// Keep the newest this many commits (0: all).
    pub keep: usize,
}

/// The chief's view of the checkpoint to resume from, checked against this run.
fn resume_from(
    restored: &Restored,
    info: &trainerd_sdk::PluginInfo,
    world: usize,
    cfg: &RunConfig,
    params: &mut [(String, Tensor)],
    optimizer: &mut Optimizer,
) -> Result<Position, String> {
    let seq = restored.record.sequence;
    let meta: Meta = serde_json::from_value(restored.manifest.meta.clone())
        .map_err(|e| format!("checkpoint {seq} was not written by this version of trainerd: {e}"))?;
    if meta.plugin != info.name {
        return Err(format!(
            "checkpoint {seq} was written by plugin {} {}, this run uses {} {}",
            meta.plugin, meta.plugin_version, info.name, info.version
        ));
    }
    if meta.workers != world {
        return Err(format!(
            "checkpoint {seq} was written by {} worker(s), this run has {world}; an exact resume needs the same              cluster size",
            meta.workers
        ));
    }
    let ours: serde_json::Value = serde_json::from_str(&cfg.agreement_json()).expect("our own JSON");
    if meta.run_config != ours {
        return Err(format!(
            "checkpoint {seq} was written with another run configuration: {} in the checkpoint, {} in this run",
            meta.run_config, ours
        ));
    }
    let blob = |name: &str| restored.blobs.get(name).ok_or_else(|| format!("checkpoint {seq} has no {name}"));
    checkpoint::copy_into(params, blob(checkpoint::MODEL_BLOB)?, "model")?;
    let state: Vec<(String, Tensor)> = blob(checkpoint::OPTIMIZER_BLOB)?
        .iter()
        .map(|t| Ok((t.name.clone(), checkpoint::to_tensor(t)?.to_device(cfg.device))))
        .collect::<Result<_, String>>()?;
    optimizer.restore(meta.position.global_step, &state).map_err(|e| format!("checkpoint {seq}: {e}"))?;
    Ok(meta.position)
}

/// Sends the chief's position, parameters and optimizer state to every worker.
fn broadcast_state(
    ring: &mut Ring,
    position: &mut Position,
    params: &mut [(String, Tensor)],
    optimizer: &mut Optimizer,
) -> Result<(), TrainError> {
    if ring.world() == 1 {
        return Ok(());
    }
    let mut head = vec![position.epoch as f64, position.step_in_epoch as f64, position.global_step as f64];
    head.extend(&position.totals);
    head.extend(&position.last_epoch);
    ring.broadcast(&mut head)?;
    let n = position.totals.len();
    *position = Position {
        epoch: head[0] as u32,
        step_in_epoch: head[1] as u64,
        global_step: head[2] as u64,
        totals: head[3..3 + n].to_vec(),
        last_epoch: head[3 + n..].to_vec(),
    };
    buckets::broadcast(ring, params)?;
    if position.global_step > 0 {
        optimizer.materialize(params);
        let mut state = optimizer.state();
        buckets::broadcast(ring, &mut state)?;
        // The broadcast wrote into the optimizer's own tensors (state() shares storage); only
        // the step count is left.
        let copies: Vec<(String, Tensor)> = state.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        optimizer.restore(position.global_step, &copies).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
    }
    Ok(())
}

/// Trains the plugin's model and evaluates it after each epoch.
pub fn run(plugin: &Plugin, cfg: &RunConfig, progress: &mut Progress) -> Result<Summary, TrainError> {
    let info = plugin.info().clone();
    let Membership { plane, mut ring } = join_cluster(plugin, cfg, progress)?;
    let (rank, world) = (ring.rank(), ring.world());
    let metric_count = info.metrics.len();

    tch::manual_seed(cfg.seed as i64);
    let model = plugin.create_model("model", cfg.device)?;
    let mut params: Vec<(String, Tensor)> =
        model.parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    let buckets = Buckets::new(&params, cfg.bucket_bytes);
    let mut optimizer = Optimizer::new(cfg.optimizer.clone(), &params);

    // Only the chief touches storage: it restores, and commits.
    let mut checkpointer = match (&cfg.checkpoint, rank) {
        (Some(c), 0) => {
            let store = c.location.open(&c.s3).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
            Some(Checkpointer::new(store, c.every, c.keep).map_err(TrainError::Checkpoint)?)
        }
        _ => None,
    };
    let fresh = Position {
        epoch: 0,
        step_in_epoch: 0,
        global_step: 0,
        totals: vec![0.0; 2 + metric_count],
        last_epoch: vec![0.0; 2 + metric_count],
    };
    let mut position = fresh.clone();
    if let Some(c) = checkpointer.as_mut() {
        let restored = c.restore().map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        if let Some(r) = restored {
            for why in &r.fallbacks {
                progress.line(&format!("warning: skipped a damaged checkpoint: {why}"));
            }
            position = resume_from(&r, &info, world, cfg, &mut params, &mut optimizer)
                .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", c.location())))?;
            progress.line(&if position.epoch >= cfg.epochs {
                format!(
                    "trainerd: checkpoint {} in {} is the end of this run (global step {})",
                    r.record.sequence,
                    c.location(),
                    position.global_step
                )
            } else {
                format!(
                    "trainerd: resumed from checkpoint {} in {} at epoch {}, step {} (global step {})",
                    r.record.sequence,
                    c.location(),
                    position.epoch + 1,
                    position.step_in_epoch,
                    position.global_step
                )
            });
        }
    }
    broadcast_state(&mut ring, &mut position, &mut params, &mut optimizer)?;

    let train_data = model.load_data(&cfg.data_dir, Split::Train)?;
    let test_data = model.load_data(&cfg.data_dir, Split::Test)?;
    let ctx = |epoch: u32, training: bool| InputContext {
        num_input_pipelines: world as u32,
        input_pipeline_id: rank as u32,
        per_replica_batch_size: cfg.batch_size,
        training,
        epoch: u64::from(epoch),
        seed: cfg.seed,
    };

    let first = train_data.pipeline(&ctx(0, true))?;
    let steps_per_epoch = cfg.steps_per_epoch.map_or(first.steps(), |s| s.min(first.steps()));
    drop(first);
    if steps_per_epoch == 0 {
        return Err(TrainError::NoSteps { batch_size: cfg.batch_size, workers: world });
    }
    let total_steps = steps_per_epoch * u64::from(cfg.epochs);
    let mut metrics_log = match &cfg.metrics_log {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| TrainError::Io { path: path.clone(), source })?,
        )),
        None => None,
    };

    let mut global_step = position.global_step;
    let mut train_time = Duration::ZERO;
    let mut examples = 0f64;
    let mut last_train = Totals::from_sums(&position.last_epoch, metric_count);
    let mut last_eval = None;
    let meta = |position: Position| Meta {
        position,
        plugin: info.name.clone(),
        plugin_version: info.version.clone(),
        workers: world,
        run_config: serde_json::from_str(&cfg.agreement_json()).expect("our own JSON"),
        rng: checkpoint::RNG_SCHEME.into(),
    };
    for epoch in position.epoch..cfg.epochs {
        progress.epoch_start(epoch, cfg.epochs);
        let mut pipeline = train_data.pipeline(&ctx(epoch, true))?;
        let resumed = if epoch == position.epoch { position.step_in_epoch } else { 0 };
        let mut totals =
            if resumed > 0 { Totals::from_sums(&position.totals, metric_count) } else { Totals::new(metric_count) };
        for _ in 0..resumed {
            pipeline.next_batch()?;
        }
        let start = Instant::now();
        let counted = totals.examples;
        for step in resumed + 1..=steps_per_epoch {
            let Some((xs, labels)) = pipeline.next_batch()? else { break };
            let lr = lr_at(&cfg.schedule, cfg.optimizer.lr(), global_step, total_steps);
            tch::manual_seed(checkpoint::step_seed(cfg.seed, global_step));
            let sums = train_step(&model, &mut params, &buckets, &mut ring, cfg.device, (&xs, &labels))?;
            optimizer.step(&mut params, lr);
            totals.add(&sums);
            global_step += 1;
            if let Some(log) = metrics_log.as_mut() {
                let mut line = serde_json::json!({"epoch": epoch, "step": step, "global_step": global_step, "lr": lr});
                let mut one = Totals::new(metric_count);
                one.add(&sums);
                for (name, value) in one.named(&info.metrics, "") {
                    line[name] = value.into();
                }
                writeln!(log, "{line}")
                    .map_err(|source| TrainError::Io { path: cfg.metrics_log.clone().unwrap_or_default(), source })?;
            }
            if let Some(c) = checkpointer.as_mut() {
                c.poll(&mut |m| progress.line(&m));
                if c.every > 0 && global_step % c.every == 0 && step < steps_per_epoch {
                    let at = Position {
                        epoch,
                        step_in_epoch: step,
                        global_step,
                        totals: totals.sums(),
                        last_epoch: last_train.sums(),
                    };
                    c.commit(&params, &optimizer.state(), &meta(at), &mut |m| progress.line(&m))
                        .map_err(TrainError::Checkpoint)?;
                }
            }
            if progress.wants(step, steps_per_epoch) {
                progress.step(step, steps_per_epoch, start.elapsed(), &totals.named(&info.metrics, ""));
            }
        }
        let elapsed = start.elapsed();
        train_time += elapsed;
        examples += totals.examples - counted;
        let eval = evaluate(&model, &test_data, &ctx(epoch, false), &mut ring, cfg.device, metric_count)?;
        let mut values = totals.named(&info.metrics, "");
        values.extend(eval.named(&info.metrics, "val_"));
        let rate = (totals.examples - counted) / elapsed.as_secs_f64().max(1e-9);
        progress.epoch_end(steps_per_epoch, elapsed, &values, rate);
        if let Some(c) = checkpointer.as_mut() {
            let at = Position {
                epoch: epoch + 1,
                step_in_epoch: 0,
                global_step,
                totals: vec![0.0; 2 + metric_count],
                last_epoch: totals.sums(),
            };
            c.commit(&params, &optimizer.state(), &meta(at), &mut |m| progress.line(&m))
                .map_err(TrainError::Checkpoint)?;
        }
        (last_train, last_eval) = (totals, Some(eval));
    }
    if let Some(log) = metrics_log.as_mut() {
        log.flush().map_err(|source| TrainError::Io { path: cfg.metrics_log.clone().unwrap_or_default(), source })?;
    }
    let last_eval = match last_eval {
        Some(eval) => eval,
        None => {
            progress.line(&format!("trainerd: the run had already finished all {} epoch(s); evaluating", cfg.epochs));
            evaluate(
                &model,
                &test_data,
                &ctx(cfg.epochs.saturating_sub(1), false),
                &mut ring,
                cfg.device,
                metric_count,
            )?
        }
    };
    let mut checkpoint_error = None;
    if let Some(c) = checkpointer.as_mut() {
        c.wait(&mut |m| progress.line(&m));
        checkpoint_error = c.last_error.clone();
    }
    if let Some(plane) = &plane {
        // Nobody leaves (and takes the chief's control plane or a ring link with it) before
        // everyone has finished.
        plane.barrier("finished")?;
    }

    let named = |values: Vec<f64>| -> BTreeMap<String, f64> { info.metrics.iter().cloned().zip(values).collect() };
    let test_metrics = named(last_eval.metric_means());
    Ok(Summary {
        plugin: info.name.clone(),
        plugin_version: info.version.clone(),
        workers: world,
        rank,
        epochs: cfg.epochs,
        steps: global_step,
        global_batch_size: u64::from(cfg.batch_size) * world as u64,
        optimizer: cfg.optimizer.clone(),
        schedule: cfg.schedule.clone(),
        seed: cfg.seed,
        device: device_name(cfg.device),
        threads: cfg.threads,
        final_train_loss: last_train.loss_mean(),
        final_train_metrics: named(last_train.metric_means()),
        test_loss: last_eval.loss_mean(),
        test_accuracy: test_metrics.get("accuracy").copied(),
        test_metrics,
        examples_per_second: examples / train_time.as_secs_f64().max(1e-9),
        train_seconds: train_time.as_secs_f64(),
        params_sha256: params_sha256(&params),
        checkpoint_error,
    })
}

/// Forward, loss and backward on this worker's slice of the global batch, then the gradients
/// averaged over the ring. Returns the step's global `[loss × n, n, metric...]`.
fn train_step(
    model: &ModelInstance<'_>,
    params: &mut [(String, Tensor)],
    buckets: &Buckets,
    ring: &mut Ring,
    device: Device,
    (xs, labels): (&Tensor, &Tensor),
) -> Result<Vec<f64>, TrainError> {
    let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
    let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
    let logits = model.forward(&xs, true)?;
    let loss = model.loss(&logits, &labels)?;
    let metrics = model.metrics(&logits.detach(), &labels)?;
    for (_, p) in params.iter_mut() {
        p.zero_grad();
    }
    loss.f_backward().map_err(torch("backward"))?;
    let sums = step_sums(xs.size()[0], &loss, &metrics)?;
    let mut extra: Vec<f32> = sums.iter().map(|&x| x as f32).collect();
    buckets.all_reduce(ring, params, &mut extra)?;
    Ok(if ring.world() == 1 { sums } else { extra.into_iter().map(f64::from).collect() })
}

/// Loss and metrics over one pass of the test split (each worker its shard), without
/// gradients, summed over the ring.
fn evaluate(
    model: &ModelInstance<'_>,
    data: &Dataset<'_>,
    ctx: &InputContext,
    ring: &mut Ring,
    device: Device,
    metrics: usize,
) -> Result<Totals, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let mut pipeline = data.pipeline(ctx)?;
    let mut sums = vec![0f64; 2 + metrics];
    while let Some((xs, labels)) = pipeline.next_batch()? {
        let n = xs.size()[0];
        if n == 0 {
            continue; // this pipeline's share of the last global batch is empty
        }
        let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let logits = model.forward(&xs, false)?;
        let step = step_sums(n, &model.loss(&logits, &labels)?, &model.metrics(&logits, &labels)?)?;
        sums.iter_mut().zip(step).for_each(|(s, x)| *s += x);
    }
    ring.all_reduce(&mut sums, ReduceOp::Sum)?;
    let mut totals = Totals::new(metrics);
    totals.add(&sums);
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
    for (name, p) in sorted {
        hasher.update(checkpoint::host_bytes(p).unwrap_or_else(|e| panic!("reading parameter {name}: {e}")));
    }
    format!("{:x}", hasher.finalize())
}
