//! A run's start-up, in the order it happens: the control plane (peers can reach this member
//! while it loads), the model and its initial state, the chief's checkpoint location (probed, and
//! the newest commit restored), the join of the first generation in the background, and the data
//! meanwhile. What start-up builds, the loop ([`super::driver`]) drives.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use trainerd_sdk::{InputContext, PluginInfo};
use trainerd_storage::Location;

use super::batches::input_context;
use super::commit::{Committer, Policy};
use super::config::RunConfig;
use super::error::TrainError;
use super::report::Reporter;
use super::session::{First, Session};
use crate::checkpoint::Checkpointer;
use crate::cluster::catch_up::NoCatchUp;
use crate::input::Data as Input;
use crate::ops::progress::Progress;
use crate::optim::optimizer::Optimizer;
use crate::plugin::{ModelInstance, Plugin};
use crate::state::{Meta, ModelState, Reader, Shareable, TrainState};

/// Opens this member's session (alone: at once), its peers to agree on `run_config` (canonical
/// JSON), and says where it listens and whom it waits for.
pub(super) fn open_session(
    plugin: &Plugin,
    (cfg, run_config): (&RunConfig, &str),
    progress: &mut Progress,
) -> Result<Session, TrainError> {
    let identity = (plugin.identity(), run_config.to_string());
    let mut session = Session::open(cfg.cluster.as_ref(), identity, cfg.member_settings())?;
    session.set_slots_per_worker(cfg.devices.len() * cfg.accumulate, cfg.shard_optimizer);
    session.set_backend(cfg.collective);
    if let Some(listening) = session.listening() {
        let how = if cfg.network.key.is_some() { "peers must prove the cluster secret" } else { "no secret" };
        progress.line(&format!("trainerd: listening on {listening} ({how})"));
    }
    match &cfg.state_dir {
        Some(dir) if session.world() > 2 => progress.line(&format!(
            "trainerd: this worker's vote for electing a coordinator if the chief is lost is kept in {}",
            dir.display()
        )),
        None if session.world() > 2 => progress.line(
            "trainerd: --no-failover: this worker takes no part in electing a new coordinator; a lost chief is \
             waited for",
        ),
        _ => {}
    }
    if session.rank() == 0 && session.world() > 1 {
        progress.line(&format!("trainerd: waiting for {} worker(s) to join", session.world()));
    }
    Ok(session)
}

/// The state of a freshly built `model`: the run's state on the chief until something better
/// turns up (a commit, a survivor's state), a placeholder elsewhere.
pub(super) fn initial_state(model: &ModelInstance<'_>, cfg: &RunConfig, info: &PluginInfo, chief: bool) -> TrainState {
    let (params, buffers) = model.split_variables();
    let model = ModelState::new((params, buffers), info.metrics.len(), cfg.device, chief);
    if cfg.shard_optimizer {
        // No member ever holds the whole optimizer state: each makes its ranges' at the first step.
        return TrainState::fresh(model, cfg.optimizer.clone());
    }
    let optimizer = Optimizer::new(cfg.optimizer.clone(), &model.params);
    TrainState::new(model, optimizer)
}

/// With checkpoints: the checkpointer (every member has one: whoever coordinates commits), its
/// location opened, nothing read. On S3 it proves the server refuses a second create-if-absent
/// write before its first commit (unless told not to, with a warning now). With the optimizer
/// state sharded over several `workers`, a restore leaves it in the commit, verified: each member
/// reads its own ranges of it (docs/fault-tolerance.md, "A sharded run's resume").
pub(super) fn checkpointer(
    cfg: &RunConfig,
    workers: usize,
    report: &mut Reporter<'_>,
) -> Result<Option<Checkpointer>, TrainError> {
    let Some(c) = cfg.checkpoint.as_ref() else { return Ok(None) };
    let mut checkpointer = Checkpointer::new(c.location.open(&c.s3)?, c.keep)?;
    if cfg.shard_optimizer && workers > 1 {
        checkpointer.stream_on_restore(crate::state::OPTIMIZER_BLOB);
    }
    if matches!(c.location, Location::S3 { .. }) {
        let endpoint = c.s3.endpoint_name();
        if c.s3.skip_probe {
            report.line(&format!(
                "warning: --s3-skip-probe: not checking that {endpoint} refuses a second create-if-absent write; if it \
                 does not, two chiefs can overwrite each other's commits"
            ));
        } else {
            checkpointer.probe_before_writing(&endpoint);
        }
    }
    Ok(Some(checkpointer))
}

/// On the coordinator (the chief, or the member its kept vote says won a term): its location
/// read, the newest commit that verifies restored into `state` (the state of last resort; a
/// survivor's is further), and the floor every formation must exceed set; whether it restored
/// one. Retries every 2 s while the location does not answer when `wait` (no member holds a
/// state: there is nothing else to train from), saying so once; `stop` ends the wait.
pub(super) fn resume(
    checkpointer: &mut Checkpointer,
    run_config: &str,
    (info, workers): (&PluginInfo, usize),
    (session, state, report): (&mut Session, &mut TrainState, &mut Reporter<'_>),
    (wait, stop): (bool, &AtomicBool),
) -> Result<bool, TrainError> {
    let location = checkpointer.location().to_string();
    report.waiting_for_cluster(&format!("restoring from {location}"));
    let mut said = false;
    let (restored, floor) = loop {
        match checkpointer.probe().and_then(|()| checkpointer.restore()) {
            Err(e) if wait && e.unanswered() && !stop.load(std::sync::atomic::Ordering::Relaxed) => {
                if !std::mem::replace(&mut said, true) {
                    report.line(&format!(
                        "trainerd: the checkpoint location {location} does not answer ({e}): no member holds a \
                         state, so the cluster waits for it; retrying every 2 s"
                    ));
                }
                std::thread::sleep(std::time::Duration::from_secs(2));
            }
            read => break read?,
        }
    };
    session.set_floor(floor);
    let Some(r) = restored else { return Ok(false) };
    for why in &r.fallbacks {
        report.line(&format!("warning: skipped a damaged checkpoint: {why}"));
    }
    let meta = Meta::read(&r, info, Reader::Training { workers, run_config })
        .map_err(|source| TrainError::Unfit { location: location.clone(), source })?;
    if meta.cluster_workers == session.world() {
        session.set_committed(r.record.generation, &meta.members);
    }
    if meta.workers != workers {
        report.line(&format!(
            "trainerd: checkpoint {} was written by {} worker(s), this run has {workers}: the same global batches \
             continue, but the gradients are summed in other groups (and dropout drawn per other ranks), so the result \
             is close to, not bit for bit, a run on {} worker(s)",
            r.record.sequence, meta.workers, meta.workers
        ));
    }
    state
        .restore(&r, meta.position)
        .map_err(|source| TrainError::Restore { location: location.clone(), source: Box::new(source) })?;
    let whose = format!("checkpoint {} in {location}", r.record.sequence);
    super::kernels::restored(&mut state.model.position, &whose, report)?;
    report.resumed(r.record.sequence, &location, state.position());
    Ok(true)
}

/// On a member with checkpoints: a probe of whether the run has finished, asked while its join
/// gets no answer (a worker that comes back after the end, its coordinator gone).
pub(super) fn finished_probe(
    (cfg, run_config): (&RunConfig, &str),
    (info, workers): (&PluginInfo, usize),
) -> Result<Option<crate::cluster::member::FinishedProbe>, TrainError> {
    let Some(c) = cfg.checkpoint.as_ref() else { return Ok(None) };
    // A few tries only: it is asked again a second later, and the join it runs beside waits for
    // it (a storage outage must not hold up a join whose coordinator comes back meanwhile).
    let store = c.location.open(&c.s3)?.with_retry(trainerd_storage::Retry { attempts: 2, ..Default::default() });
    let checkpointer = std::sync::Mutex::new(Checkpointer::new(store, c.keep)?);
    let (epochs, run_config, info) = (cfg.epochs, run_config.to_string(), info.clone());
    Ok(Some(std::sync::Arc::new(move || {
        let checkpointer = checkpointer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        finished(&checkpointer, epochs, (&info, workers, &run_config))
    })))
}

/// Whether the latest commit at the checkpoint location is the final state of this run's
/// configuration (its last epoch done, or stopped early): what to say, naming the step and commit.
/// Only the latest record is read, and the commit itself only when that record is at or past the
/// last epoch; a location that cannot be read, or a commit that does not verify, tells nothing.
fn finished(
    checkpointer: &Checkpointer,
    epochs: u32,
    (info, workers, run_config): (&PluginInfo, usize, &str),
) -> Option<String> {
    let record = checkpointer.latest().ok()??;
    if record.epoch < u64::from(epochs) {
        return None;
    }
    let restored = checkpointer.load(record.sequence).ok()?;
    let meta = Meta::read(&restored, info, Reader::Training { workers, run_config }).ok()?;
    let done = meta.position.epoch >= epochs || meta.position.callbacks.stopped_after.is_some();
    done.then(|| {
        let (step, location) = (meta.position.global_step, checkpointer.location());
        format!("the run finished at step {step} (commit {} in {location})", record.sequence)
    })
}

/// The chief's committer over `checkpointer`, once the steps of an epoch are known; each commit
/// records `run_config`.
pub(super) fn committer(
    checkpointer: Option<Checkpointer>,
    (cfg, run_config): (&RunConfig, &str),
    (info, workers): (&PluginInfo, usize),
    steps_per_epoch: u64,
) -> Option<Committer> {
    let every = cfg.checkpoint.as_ref().map_or(0, |c| c.every);
    let policy = Policy { every, steps_per_epoch };
    let best = cfg.checkpoint.as_ref().and_then(|c| c.best.clone());
    checkpointer.map(|c| Committer::new(c, policy, info, workers, run_config.to_string()).keeping_best(best))
}

/// What the joining thread gives back: the session and the state it took, and how the join went
/// (or the catch-up stream to replay first).
pub(super) type Joining = JoinHandle<(Session, TrainState, First)>;

/// Joins the first generation on a thread of its own, once the data is loaded (a worker returning
/// to a running cluster ends its generation by joining: its peers wait from then on): the
/// rendezvous, the ring and the state transfer (a fresh worker reports no state; the chief
/// reports what it restored).
pub(super) fn join_in_background(
    mut session: Session,
    state: TrainState,
    stop: &Arc<AtomicBool>,
    report: &Reporter<'_>,
    cfg: &RunConfig,
) -> Result<Joining, TrainError> {
    report.waiting("joining the cluster", cfg.timeouts.rendezvous);
    let stop = Arc::clone(stop);
    let catch_up = cfg.catch_up_memory > 0;
    std::thread::Builder::new()
        .name("trainerd-join".into())
        .spawn(move || {
            // A worker that starts while the others train catches up first: it replays their
            // steps instead of pausing them (refused at once when nothing trains yet).
            let mut refused = None;
            if catch_up && session.clustered() && !session.coordinates() {
                match session.catch_up() {
                    Ok(catching) => return (session, state, First::CatchUp(catching)),
                    Err(NoCatchUp::NothingTrains(why)) => tracing::debug!("no catch-up: {why}"),
                    Err(NoCatchUp::Refused(why)) => refused = Some(why),
                }
            }
            let joined = session.join(Some(&state as &dyn Shareable), &stop);
            (session, state, First::Joined(joined, refused))
        })
        .map_err(|source| TrainError::Start { what: "the joining thread", source })
}

/// The model's data, this worker's input context, and the steps of an epoch.
pub(super) struct Data<'m> {
    /// Both splits.
    pub(super) input: Input<'m>,
    /// This worker's input pipeline (its epoch and `training` set per use).
    pub(super) ctx: InputContext,
    /// Steps per epoch (the pipeline's, or fewer when the run says so).
    pub(super) steps_per_epoch: u64,
}

/// Both splits (loaded through the plugin, or the columnar dataset's readers), for slot `rank`
/// of `world` (the run's slots).
pub(super) fn load_data<'m>(
    model: &'m ModelInstance<'m>,
    cfg: &RunConfig,
    (rank, world): (usize, usize),
) -> Result<Data<'m>, TrainError> {
    let input = Input::load(&cfg.data, model)?;
    let ctx = input_context((rank, world), cfg.batch_size, (true, 0, cfg.seed));
    let pipeline_steps = input.steps(&ctx)?;
    let steps_per_epoch = cfg.steps_per_epoch.map_or(pipeline_steps, |s| s.min(pipeline_steps));
    if steps_per_epoch == 0 {
        return Err(TrainError::NoSteps { batch_size: cfg.batch_size, workers: world });
    }
    Ok(Data { input, ctx, steps_per_epoch })
}
