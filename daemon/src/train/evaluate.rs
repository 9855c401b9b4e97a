//! `trainerd evaluate`: a committed checkpoint's loss and metrics on the test split, as Keras's
//! `model.evaluate` after loading a checkpoint. Alone, or sharded over a TF_CONFIG cluster: the
//! chief reads the checkpoint (the newest that verifies, or the one asked for), the members that
//! lack it receive its model through the same sha256-verified transfer a recovery uses, each
//! member evaluates its shard, and the sums are added over the ring.
//!
//! Only the model's state (position, parameters and buffers) is taken and shared: evaluation
//! needs no optimizer.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use serde::Serialize;
use trainerd_sdk::PluginInfo;

use crate::cluster::coordinator::rules::FINAL_BARRIER;
use crate::cluster::member::Settings;
use crate::input::Data;
use crate::ops::progress::Progress;
use crate::plugin::Plugin;
use crate::state::{Meta, ModelState, Reader, Shareable, Totals};
use crate::train::agreement::{agreement, Job};
use crate::train::batches::input_context;
use crate::train::error::TrainError;
use crate::train::jobs::EvalConfig;
use crate::train::session::{Interrupt, Session};
use crate::train::step;
use crate::train::summary::device_name;

/// The result, written as JSON by `--summary`.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Evaluation {
    /// Plugin name.
    pub(crate) plugin: String,
    /// Plugin version.
    pub(crate) plugin_version: String,
    /// The checkpoint location.
    pub(crate) checkpoint: String,
    /// The commit evaluated.
    pub(crate) sequence: u64,
    /// Epochs the checkpoint had completed.
    pub(crate) epoch: u32,
    /// Its global step.
    pub(crate) global_step: u64,
    /// Workers that evaluated.
    pub(crate) workers: usize,
    /// Per-worker batch size.
    pub(crate) batch_size: u32,
    /// Test examples evaluated.
    pub(crate) examples: u64,
    /// Mean loss on the test split.
    pub(crate) test_loss: f64,
    /// Accuracy, when the plugin reports `accuracy`.
    pub(crate) test_accuracy: Option<f64>,
    /// Mean of each metric.
    pub(crate) test_metrics: BTreeMap<String, f64>,
    /// Seconds the pass took.
    pub(crate) seconds: f64,
    /// Device.
    pub(crate) device: String,
    /// sha256 over the model's variables, as a training summary's `params_sha256`.
    pub(crate) params_sha256: String,
}

/// The interrupt of an evaluation, as an error: there is no state to keep, so a failed member
/// ends it (run it again).
pub(crate) fn failed(interrupt: Interrupt) -> TrainError {
    match interrupt {
        Interrupt::Fatal(e) => e,
        Interrupt::Abandoned(why) => TrainError::EvaluationAbandoned(why),
        Interrupt::Stopped => TrainError::Stopped,
        Interrupt::ReadFirst => TrainError::Cluster(crate::cluster::ClusterError::ReadFirst),
    }
}

/// A committed checkpoint's model on every member of the cluster (or alone): the session, the
/// model instance holding it, and its state.
pub(crate) struct Loaded<'p> {
    /// The cluster's session.
    pub(crate) session: Session,
    /// The model, its variables the checkpoint's.
    pub(crate) model: crate::plugin::ModelInstance<'p>,
    /// Its state (position, variables).
    pub(crate) state: ModelState,
    /// The commit.
    pub(crate) sequence: u64,
}

/// Joins the cluster (or not), and puts the checkpoint's model in `plugin`'s model on every
/// member: the chief restores it, the others receive it. `stop` ends a wait for the cluster.
pub(crate) fn load<'p>(
    plugin: &'p Plugin,
    (cfg, job): (&EvalConfig, Job<'_>),
    progress: &mut Progress,
    stop: &AtomicBool,
) -> Result<Loaded<'p>, TrainError> {
    let info = plugin.info();
    let identity = (plugin.identity(), agreement(job));
    // An evaluation keeps no vote and records no position.
    let settings = Settings { timeouts: cfg.timeouts, network: &cfg.network, state_dir: None };
    let mut session = Session::open(cfg.cluster.as_ref(), identity, settings)?;
    let rank = session.rank();
    let model = plugin.create_model(crate::plugin::MODEL_PATH, cfg.device)?;
    let mut state = ModelState::new(model.split_variables(), info.metrics.len(), cfg.device, rank == 0);
    let sequence = if rank == 0 { restore(cfg, info, &mut state, progress)? } else { 0 };
    let sequence = share(&mut session, &mut state, sequence, stop)?;
    Ok(Loaded { session, model, state, sequence })
}

/// Evaluates the checkpoint on the test split; `stop` ends a wait for the cluster.
pub(crate) fn run(
    plugin: &Plugin,
    cfg: &EvalConfig,
    progress: &mut Progress,
    stop: &AtomicBool,
) -> Result<Evaluation, TrainError> {
    let info = plugin.info();
    let Loaded { mut session, model, state, sequence } = load(plugin, (cfg, Job::Evaluation(cfg)), progress, stop)?;
    let (rank, world) = (session.rank(), session.world());
    let test_data = Data::load(&cfg.data, &model)?;
    let ctx = input_context((rank, world), cfg.batch_size, (false, u64::from(state.position.epoch), 0));
    let began = Instant::now();
    let totals = step::evaluate(
        &model,
        &test_data,
        std::slice::from_ref(&ctx),
        session.collective(),
        (cfg.device, info.metrics.len(), cfg.precision),
        &mut Default::default(),
    )
    .map_err(|e| failed(session.interrupt(e)))?;
    let seconds = began.elapsed().as_secs_f64();
    if world > 1 {
        session.barrier(FINAL_BARRIER).map_err(failed)?;
        session.finish();
    }
    let steps = (totals.examples() / (f64::from(cfg.batch_size) * world as f64)).ceil() as u64;
    let mut values = totals.named(&info.metrics, "");
    if info.language_model {
        values = crate::ops::progress::with_perplexity(values);
    }
    let rate = totals.examples() / seconds.max(1e-9);
    let tokens = info.columns.as_ref().and_then(trainerd_sdk::Columns::tokens_per_example);
    progress.epoch_end(steps, began.elapsed(), &values, (rate, tokens.map(|t| rate * f64::from(t))));
    Ok(Evaluation::new((cfg, info, world), (sequence, &state), &totals, seconds))
}

/// On the chief: the commit asked for (or the newest that verifies) restored into `state`; its
/// sequence.
fn restore(
    cfg: &EvalConfig,
    info: &PluginInfo,
    state: &mut ModelState,
    progress: &mut Progress,
) -> Result<u64, TrainError> {
    let location = cfg.location.to_string();
    let store = cfg.location.open(&cfg.s3)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| TrainError::Start { what: "the storage runtime", source })?;
    let restored = match cfg.sequence {
        Some(n) => runtime.block_on(store.load(n))?,
        None => runtime.block_on(store.latest())?.ok_or_else(|| TrainError::NoCommit { location: location.clone() })?,
    };
    for why in &restored.fallbacks {
        progress.line(&format!("warning: skipped a damaged checkpoint: {why}"));
    }
    let sequence = restored.record.sequence;
    let meta = Meta::read(&restored, info, Reader::Evaluation)
        .map_err(|source| TrainError::Unfit { location: location.clone(), source })?;
    state
        .restore(&restored, meta.position)
        .map_err(|source| TrainError::Restore { location, source: Box::new(source) })?;
    progress.line(&format!(
        "trainerd: evaluating checkpoint {sequence} of {} (epoch {}, global step {})",
        cfg.location, state.position.epoch, state.position.global_step
    ));
    Ok(sequence)
}

/// Joins the cluster: the members that lack the chief's model receive it, and every member
/// learns which commit it is. Alone, at once.
fn share(session: &mut Session, state: &mut ModelState, sequence: u64, stop: &AtomicBool) -> Result<u64, TrainError> {
    let joined = session.join(Some(&*state as &dyn Shareable), stop).map_err(failed)?;
    if let Some(bytes) = joined.received {
        state.decode(bytes.into())?;
    }
    let mut seq = [sequence];
    session
        .collective()
        .broadcast(0, bytemuck::cast_slice_mut(&mut seq))
        .map_err(|e| failed(session.interrupt(e.into())))?;
    Ok(seq[0])
}

impl Evaluation {
    /// The result of evaluating commit `sequence` (`state`) on `world` workers: `totals` in
    /// `seconds`.
    fn new(
        (cfg, info, world): (&EvalConfig, &PluginInfo, usize),
        (sequence, state): (u64, &ModelState),
        totals: &Totals,
        seconds: f64,
    ) -> Evaluation {
        let test_metrics: BTreeMap<String, f64> = totals.named(&info.metrics, "").into_iter().skip(1).collect();
        Evaluation {
            plugin: info.name.clone(),
            plugin_version: info.version.clone(),
            checkpoint: cfg.location.to_string(),
            sequence,
            epoch: state.position.epoch,
            global_step: state.position.global_step,
            workers: world,
            batch_size: cfg.batch_size,
            examples: totals.examples() as u64,
            test_loss: totals.loss_mean(),
            test_accuracy: test_metrics.get("accuracy").copied(),
            test_metrics,
            seconds,
            device: device_name(cfg.device),
            params_sha256: state.params_sha256(),
        }
    }
}
