//! How a generation's training ends on a member: the run's end (its last comparison and commit,
//! then the final barrier), a return (the step's barrier, then every member rejoins), a stop (the
//! state made whole and committed, the stopped members leave), a stop while waiting for the
//! cluster; and the run's summary.

use std::collections::{BTreeMap, BTreeSet};

use super::{Driver, Ended, Next};
use crate::cluster::coordinator::rules::{CAME_BACK, FINAL_BARRIER};
use crate::state::{Totals, TrainState};
use crate::train::commit::{Committer, Moment};
use crate::train::error::TrainError;
use crate::train::memory::Memory;
use crate::train::session::{Interrupt, Session};
use crate::train::summary::Outcome;
use crate::train::summary::{device_name, Summary};

impl Driver<'_> {
    /// After `train`: the end of the run (every member's final barrier, the chief's last commit
    /// done before it), a stop (the chief commits; then the stopped members leave), or a return
    /// (every member meets at the step's barrier, then rejoins).
    pub(super) fn conclude(
        &mut self,
        state: &mut TrainState,
        session: &mut Session,
        ended: Ended,
    ) -> Result<Next, Interrupt> {
        match ended {
            Ended::Finished => {
                self.check(state, session)?;
                // The last commit completes before anyone leaves: a chief lost during it is
                // recovered from a member that still holds the final state.
                self.commit(Moment::Finish, state, session)?;
                self.report.waiting_for_cluster("waiting for every worker to finish");
                // Chaos tests hold a member here while the others wait in the barrier.
                trainerd_failpoint::point("final-barrier");
                session.barrier(FINAL_BARRIER)?;
                session.finish();
                Ok(Next::Complete)
            }
            Ended::Return(ranks) => {
                let names: Vec<String> = ranks.iter().map(|&r| session.name(r)).collect();
                // Every member passed the step, its comparison and its commit before any leaves
                // the generation (the first join ends it): nothing in flight is cut short. A
                // sharded state stays sharded: its ranges move when the next generation forms.
                self.report.waiting_for_cluster("waiting for every worker to end the generation");
                session.barrier(&format!("return@{}", state.position().global_step))?;
                Ok(Next::Rejoin(format!("{} {CAME_BACK}", names.join(", "))))
            }
            Ended::Stop(slots) => {
                let stopping: BTreeSet<usize> = slots.iter().map(|&slot| session.holder(slot)).collect();
                let names: Vec<String> = stopping.iter().map(|&r| session.name(r)).collect();
                let step = state.position().global_step;
                self.make_whole(state, session)?;
                let saved = self.commit(Moment::Stop, state, session)?;
                self.report.waiting_for_cluster("waiting for every worker to stop");
                session.barrier(&format!("stop@{step}"))?;
                if stopping.contains(&session.rank()) {
                    session.leave("was stopped (SIGTERM)");
                    return Ok(Next::Exit(Outcome::Stopped { step, saved: self.saved(saved, state) }));
                }
                Err(Interrupt::Abandoned(format!("{} stopped (SIGTERM) after step {step}", names.join(", "))))
            }
        }
    }

    /// Stopped while waiting for the cluster: the chief commits what it holds first (not a
    /// sharded optimizer's state, which it does not hold whole: the latest commit stands).
    pub(super) fn stopped(&mut self, state: &TrainState) -> Result<Outcome, TrainError> {
        if state.optimizer.sharded() {
            let saved = "not saved: the optimizer state is sharded and its members are gone; the latest commit stands";
            return Ok(Outcome::Stopped { step: state.position().global_step, saved: saved.into() });
        }
        if let crate::state::Optim::Committed { sequence, .. } = &state.optimizer {
            // Restored and stopped before a generation formed to read it: the commit is the state.
            let location = self.cfg.checkpoint.as_ref().map_or_else(String::new, |c| format!(" in {}", c.location));
            let saved = format!("already committed as checkpoint {sequence}{location}, which it was restored from");
            return Ok(Outcome::Stopped { step: state.position().global_step, saved });
        }
        let saved = self.commit_whole(Moment::Stop, state)?;
        Ok(Outcome::Stopped { step: state.position().global_step, saved: self.saved(saved, state) })
    }

    /// Where the state of a stopped worker lives on.
    fn saved(&self, sequence: Option<u64>, state: &TrainState) -> String {
        match self.committer.as_ref().filter(|_| self.coordinates) {
            Some(c) => c.saved(sequence, state.position().progress()),
            None if self.cfg.checkpoint.is_some() => "held by the coordinator".into(),
            None => "not saved (no --checkpoint-dir)".into(),
        }
    }

    pub(super) fn summary(self, state: &TrainState, session: &Session) -> Summary {
        let (cfg, info, world) = (self.cfg, self.info, session.world());
        let p = state.position();
        let named = |values: Vec<f64>| -> BTreeMap<String, f64> { info.metrics.iter().cloned().zip(values).collect() };
        let test_metrics = p.last_eval.as_ref().map(|e| named(e.metric_means())).unwrap_or_default();
        let checkpoint_error = self.committer.as_ref().and_then(Committer::last_error);
        let tokens_per_example = info.columns.as_ref().and_then(trainerd_sdk::Columns::tokens_per_example);
        let (examples_per_second, train_seconds, fault_tolerance, step_phases) = self.report.finish();
        let tokens_per_second = tokens_per_example.map(|t| examples_per_second * f64::from(t));
        Summary {
            plugin: info.name.clone(),
            plugin_version: info.version.clone(),
            workers: world,
            workers_present: session.members().len(),
            slots: session.slots().iter().collect(),
            rank: session.rank(),
            epochs: cfg.epochs,
            stopped_early_after_epoch: p.callbacks.stopped_after,
            steps: p.global_step,
            global_batch_size: u64::from(cfg.batch_size) * session.slot_count() as u64,
            replicas: cfg.devices.len(),
            accumulate: cfg.accumulate,
            precision: cfg.precision.name(),
            loss_scale: p.loss_scale,
            optimizer: cfg.optimizer.clone(),
            schedule: cfg.schedule.clone(),
            seed: cfg.seed,
            device: device_name(cfg.device),
            threads: cfg.threads,
            final_train_loss: p.last_epoch.loss_mean(),
            final_train_metrics: named(p.last_epoch.metric_means()),
            test_loss: p.last_eval.as_ref().map(Totals::loss_mean),
            test_accuracy: test_metrics.get("accuracy").copied(),
            test_metrics,
            examples_per_second,
            tokens_per_second,
            test_perplexity: p.last_eval.as_ref().filter(|_| info.language_model).map(|e| e.loss_mean().exp()),
            train_seconds,
            step_phases,
            params_sha256: state.model.params_sha256(),
            fault_tolerance,
            cpu_capability: p.cpu_capability.clone(),
            integrity: self.integrity.figures(),
            checkpoint_error,
            data: cfg.data.figures(),
            peak_rss_bytes: crate::train::summary::peak_rss_bytes(),
            optimizer_state_bytes: state.optimizer.state_bytes(),
            memory: Memory::of(state, &self.buckets, cfg.shard_gradients),
        }
    }
}
