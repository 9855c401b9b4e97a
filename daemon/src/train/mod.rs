//! The training loop: synchronous data parallelism over the ring (a ring of one when there is
//! no cluster). Every worker computes gradients on its slice of each global batch, the ring
//! averages them, and every worker applies the same update, so the replicas stay identical.
//! Each epoch ends with an evaluation on the test split, each worker evaluating its shard, the
//! totals summed over the ring.
//!
//! The loop survives its peers. Its state is one value ([`crate::state::TrainState`]); a step
//! ends as done or abandoned, never as an exit because a peer failed: on a failure the member
//! keeps its process and its state, joins the next generation, and continues from the furthest
//! state any member holds ([`session`]; the protocol is `docs/fault-tolerance.md`). Only the
//! chief touches storage: it restores at start (the state of last resort) and commits.
//!
//! Everything that decides the result is fixed by the configuration: libtorch's generator is
//! seeded before the model is built and re-seeded from (seed, step, rank) before every step,
//! each epoch's data order comes from (seed, epoch), the all-reduce adds in a fixed order, and
//! the learning rate is a function of the global step. The same configuration and thread count
//! give bit-identical parameters, with failures or without.
//!
//! The parts: [`startup`] builds what a run needs, [`driver`] is the loop (generations, epochs,
//! steps), [`step`] one step and one evaluation pass, [`batches`] the data by (epoch, step),
//! [`replicas`] a daemon's further devices, [`report`] everything the run tells the outside,
//! [`commit`] when the chief commits, [`session`] a member's place in the cluster, [`summary`] the
//! result; [`sharded_step`] the sharded step's reduction and update (`--shard-optimizer`), and
//! [`parts`] a member's parts of a sharded commit; [`config`] what a run is told, [`error`] why it
//! stopped. The children take these from their leaf files, never from this one.

pub(crate) mod agreement;
pub(crate) mod batches;
pub(crate) mod commit;
pub(crate) mod config;
pub(crate) mod driver;
pub(crate) mod error;
pub(crate) mod evaluate;
pub(crate) mod integrity;
pub(crate) mod jobs;
pub(crate) mod kernels;
pub(crate) mod memory;
pub(crate) mod parts;
pub(crate) mod predict;
pub(crate) mod replicas;
pub(crate) mod report;
pub(crate) mod session;
pub(crate) mod sharded_step;
pub(crate) mod startup;
pub(crate) mod step;
pub(crate) mod summary;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use crate::collective::buckets::Buckets;
use crate::optim::optimizer::Optimizer;
use crate::plugin::{registered_names, Plugin};
pub(crate) use config::{CheckpointConfig, RunConfig};
use driver::Driver;
pub(crate) use error::TrainError;
use replicas::Replicas;
use report::{Outputs, Reporter};
pub(crate) use summary::Outcome;

/// Trains the plugin's model and evaluates it after each epoch, surviving the failure of any
/// member as long as the cluster re-forms. `stop` (SIGTERM) ends the run at the next step
/// boundary after the cluster's commit.
pub(crate) fn run(
    plugin: &Plugin,
    cfg: &RunConfig,
    outputs: Outputs<'_>,
    stop: &Arc<AtomicBool>,
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let info = plugin.info().clone();
    // What every worker must agree on, which every commit records and a resume checks.
    let run_config = agreement::agreement(agreement::Job::Training(cfg));
    let mut session = startup::open_session(plugin, (cfg, &run_config), outputs.progress)?;
    // The math's world: every replica of every worker is a slot.
    let (rank, world) = (session.rank(), session.slot_count());
    tracing::debug!("start-up: control plane up after {:?}", started.elapsed());
    let mut report = Reporter::open(cfg, &info, rank == 0, outputs)?;
    tch::manual_seed(cfg.seed as i64);
    let model = plugin.create_model(crate::plugin::MODEL_PATH, cfg.device)?;
    // A process that coordinates reads its checkpoint location before it joins only where it
    // cannot join first (alone, or without a state directory): else its state is a placeholder,
    // and it reads the location only if the formation finds no member holding a state.
    let reads_now = session.coordinates() && !session.unread();
    let mut state = startup::initial_state(&model, cfg, &info, reads_now);
    if let Some(groups) = Optimizer::describe_groups(&cfg.optimizer, &state.model.params) {
        report.line(&format!("trainerd: {groups}"));
    }
    let replicas = Replicas::build(plugin, &cfg.devices, cfg.precision)?;
    let buckets = Buckets::in_modules_order(&state.model.params, cfg.bucket_bytes, &registered_names(&info));
    if world > 1 {
        report.line(&format!(
            "trainerd: {}",
            buckets.describe(cfg.bucket_bytes, driver::overlap(cfg, false, false, None).is_some())
        ));
        report.line(&memory::plan(cfg, &state.model.params, session.world()));
    }
    let mut checkpointer = startup::checkpointer(cfg, session.world(), &mut report)?;
    let resumed = match checkpointer.as_mut().filter(|_| reads_now) {
        Some(c) => {
            let at = (&mut session, &mut state, &mut report);
            startup::resume(c, &run_config, (&info, world), at, (false, stop))?
        }
        None => false,
    };
    // A coordinator too: the chief, or a worker whose kept vote won a term, restarted after the
    // others finished under another coordinator, finds no member to form a generation with.
    if let Some(probe) = startup::finished_probe((cfg, &run_config), (&info, world))? {
        session.set_finished_probe(probe);
    }
    tracing::debug!("start-up: model built (and restored) after {:?}", started.elapsed());
    // The data first, then the join: a worker that returns to a running cluster ends its
    // generation by joining, so everything slow is done before (the peers wait from then on).
    let data = startup::load_data(&model, cfg, (rank, world))?;
    tracing::debug!("start-up: data loaded after {:?}", started.elapsed());
    let joining = startup::join_in_background(session, state, stop, &report, cfg)?;
    let committer = startup::committer(checkpointer, (cfg, &run_config), (&info, world), data.steps_per_epoch);
    let (session, state, joined) = joining.join().expect("the joining thread does not panic");
    tracing::debug!("start-up: joined after {:?}", started.elapsed());
    let driver = Driver::new((cfg, &info), (&model, replicas, &data), buckets, (report, committer), stop);
    driver.resumed(resumed).run(session, state, joined, started)
}
