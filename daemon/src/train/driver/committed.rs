//! A sharded run's optimizer state read from a commit by range (docs/fault-tolerance.md, "A
//! sharded run's resume"): as a generation forms on a state whose optimizer state is a commit's
//! ([`Optim::Committed`]: a resume, or every member gone back to the last commit), each member
//! reads its own ranges and its buddy copies from the checkpoint location, so that no member
//! holds the state whole.

use std::ops::Range;
use std::time::Instant;

use tch::Tensor;
use trainerd_sdk::OptimizerConfig;
use trainerd_storage::{Dtype, TensorData};

use super::Driver;
use crate::checkpoint::Checkpointer;
use crate::optim::sharded_state::{Held, ShardedOptimizer};
use crate::state::{host, Optim, TrainState, OPTIMIZER_BLOB};
use crate::train::session::{Interrupt, Session};
use crate::train::sharded_step;

/// The commit a committed optimizer state is read from: its sequence and its manifest's sha256.
type Commit<'a> = (u64, &'a str);

impl Driver<'_> {
    /// Reads this member's ranges of a committed optimizer state (its own and its buddy copies,
    /// as this generation's slots cut them), then every member says whether it read them. Where
    /// every member did, each holds its ranges (alone, the whole state) and nothing moves: true.
    /// Where some could not (a checkpoint directory local to each node), the coordinator reads
    /// every range, the others keep what they read, and the reshard moves the ranges to their
    /// owners: false. Where the coordinator could not either, every member keeps the state
    /// unread, and the generation is abandoned after 2 s, to read it again in the next.
    pub(super) fn read_committed(&mut self, state: &mut TrainState, session: &mut Session) -> Result<bool, Interrupt> {
        let Optim::Committed { config, sequence, manifest } = &state.optimizer else { return Ok(true) };
        let (config, commit, began) =
            ((config.clone(), state.position().global_step), (*sequence, manifest.as_str()), Instant::now());
        let v = session.slot_count();
        let ranges = self.buckets.ranges(&state.model.params, v, self.extra_len(v));
        let (mine, buddied) = sharded_step::holding(&ranges, session.collective());
        let held = (sharded_step::with_pieces(&ranges, &mine), sharded_step::with_pieces(&ranges, &buddied));
        let checkpointer = self.committer.as_mut().map(|c| &*c.checkpointer());
        let location = checkpointer.map_or_else(|| "no location".to_string(), |c| c.location().to_string());
        let read = |held: Held| read(checkpointer, commit, &config, &state.model.params, held);
        let own = read((&held.0[..], &held.1[..]));
        let flags = session.gather(&[if own.is_ok() { 0.0 } else { 1.0 }])?;
        let failed: Vec<usize> = (0..flags.len()).filter(|&p| flags[p] > 0.5).collect();
        let names = failed.iter().map(|&p| session.name_at(p)).collect::<Vec<_>>().join(", ");
        if let Err(why) = &own {
            self.report.line(&format!(
                "trainerd: this worker could not read its ranges of the optimizer state from checkpoint {} in \
                 {location}: {why}",
                commit.0
            ));
        }
        let next = match own {
            Ok(next) if failed.is_empty() => next,
            _ if failed.contains(&self.coordinator) => {
                std::thread::sleep(std::time::Duration::from_secs(2));
                return Err(Interrupt::Abandoned(format!(
                    "{names} could not read their ranges of the optimizer state from checkpoint {} (the coordinator \
                     among them): every member keeps it unread, and reads it again as the next generation forms",
                    commit.0
                )));
            }
            own => {
                // The coordinator reads every range; the reshard moves them to their owners.
                let every = sharded_step::with_pieces(&ranges, &(0..ranges.len()).collect::<Vec<_>>());
                let whole = self.coordinates.then(|| read((&every[..], &[]))).and_then(Result::ok);
                let none = || ShardedOptimizer::new(config.0.clone(), &state.model.params, (&[], &[]));
                self.report.line(&format!(
                    "trainerd: {names} could not read their ranges of the optimizer state from checkpoint {} (a \
                     checkpoint directory local to each node?): the coordinator read it whole, and the ranges move \
                     to their owners",
                    commit.0
                ));
                state.optimizer = Optim::Sharded(whole.or(own.ok()).unwrap_or_else(none));
                return Ok(false);
            }
        };
        self.report.line(&format!(
            "trainerd: this worker read its {} range(s) of the optimizer state and a buddy copy of {} from checkpoint \
             {} in {location}, {:.1} MB ({:.2}s): no member holds it whole",
            mine.len(),
            buddied.len(),
            commit.0,
            next.state_bytes() as f64 / 1e6,
            began.elapsed().as_secs_f64()
        ));
        self.hold(state, session, (next, ranges))?;
        Ok(true)
    }

    /// This member holds `next`, its ranges of this generation's `ranges` (alone: every range,
    /// made whole, as an unsharded step needs).
    fn hold(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        (next, ranges): (ShardedOptimizer, Vec<crate::collective::buckets::Range>),
    ) -> Result<(), Interrupt> {
        state.optimizer = Optim::Sharded(next);
        self.sharding = Some((session.generation(), ranges));
        self.integrity.forget_agreed();
        if session.collective().world() < 2 {
            self.make_whole(state, session)?;
        }
        Ok(())
    }
}

/// The ranges `held` of the optimizer state `commit` holds, read from `checkpointer`'s location
/// (a member without one reads nothing); why not, as a line.
fn read(
    checkpointer: Option<&Checkpointer>,
    commit: Commit<'_>,
    (config, steps): &(OptimizerConfig, u64),
    params: &[(String, Tensor)],
    held: Held,
) -> Result<ShardedOptimizer, String> {
    let checkpointer = checkpointer.ok_or("this worker has no checkpoint location")?;
    if trainerd_failpoint::hit("committed-read-fails") {
        return Err("failpoint committed-read-fails".into());
    }
    let blob = checkpointer.blob_ranges(commit, OPTIMIZER_BLOB).map_err(|e| e.to_string())?;
    // Each state tensor has its parameter's elements (a commit of another model is refused before).
    for name in blob.names() {
        let param = params.iter().find(|(p, _)| name.strip_prefix(p.as_str()).is_some_and(|s| s.starts_with('/')));
        let (_, shape) = blob.tensor(name).expect("listed");
        if let Some((p, t)) = param.filter(|(_, t)| t.numel() != shape.iter().product::<usize>()) {
            return Err(format!("tensor {name} has shape {shape:?}, parameter {p} has {:?}", t.size()));
        }
    }
    let has = |name: &str| blob.tensor(name).is_some();
    ShardedOptimizer::from_ranges((config.clone(), *steps), params, held, &has, |wants| {
        let asked: Vec<(&str, Range<usize>)> = wants.iter().map(|(n, r)| (n.as_str(), r.clone())).collect();
        let bytes = checkpointer.read_ranges(&blob, &asked).map_err(|e| e.to_string())?;
        let dtype = |name: &str| blob.tensor(name).expect("asked only what it has").0;
        wants.iter().zip(bytes).map(|((name, _), b)| floats(name, dtype(name), b)).collect()
    })
}

/// Elements of tensor `name` of type `dtype` as float32 (an optimizer's state is float32; a
/// whole optimizer of another precision's is converted as [`ShardedOptimizer::of`] converts it).
fn floats(name: &str, dtype: Dtype, bytes: Vec<u8>) -> Result<Vec<f32>, String> {
    if dtype == Dtype::F32 {
        return Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect());
    }
    let len = bytes.len() / dtype.size();
    let t = TensorData { name: name.to_string(), dtype, shape: vec![len], data: bytes.into() };
    let t = host::to_tensor(&t).map_err(|e| e.to_string())?;
    Vec::<f32>::try_from(t.to_kind(tch::Kind::Float)).map_err(|e| format!("tensor {name}: {e}"))
}
