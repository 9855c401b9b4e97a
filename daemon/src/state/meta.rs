//! A trainerd checkpoint's metadata (the manifest's `meta`): where training stood, and what must
//! match to continue from it. [`Meta::read`] and the checks are the one place that decides
//! whether a commit belongs to a run, for training (which resumes it) and evaluation (which only
//! needs the same model).

use serde::{Deserialize, Serialize};
use trainerd_sdk::PluginInfo;
use trainerd_storage::Restored;

use super::position::{Position, RNG_SCHEME};

/// The manifest metadata of a trainerd checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    /// Position.
    pub position: Position,
    /// Plugin name.
    pub plugin: String,
    /// Plugin version.
    pub plugin_version: String,
    /// Workers that trained.
    pub workers: usize,
    /// Everything that must agree to continue exactly (the run configuration as the cluster
    /// checks it).
    pub run_config: serde_json::Value,
    /// How the RNG continues.
    pub rng: String,
}

/// Who reads a checkpoint, which decides what must match and how a mismatch is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader<'a> {
    /// A run that resumes it: the plugin, the cluster size and the run configuration (canonical
    /// JSON) must be the checkpoint's.
    Training {
        /// Workers of this run.
        workers: usize,
        /// This run's configuration, canonical JSON.
        run_config: &'a str,
    },
    /// An evaluation: only the plugin must be the checkpoint's.
    Evaluation,
}

impl Meta {
    /// The metadata of a commit of `position` by `workers` workers of `info`'s plugin with
    /// `run_config` (canonical JSON).
    pub fn new(position: Position, info: &PluginInfo, workers: usize, run_config: &str) -> Meta {
        Meta {
            position,
            plugin: info.name.clone(),
            plugin_version: info.version.clone(),
            workers,
            run_config: serde_json::from_str(run_config).expect("canonical JSON of our own"),
            rng: RNG_SCHEME.into(),
        }
    }

    /// The metadata of a restored commit, checked for `reader` against `info`'s plugin.
    pub fn read(restored: &Restored, info: &PluginInfo, reader: Reader<'_>) -> Result<Meta, String> {
        let seq = restored.record.sequence;
        let meta: Meta = serde_json::from_value(restored.manifest.meta.clone())
            .map_err(|e| format!("checkpoint {seq} was not written by this version of trainerd: {e}"))?;
        meta.check(seq, info, reader)?;
        Ok(meta)
    }

    /// Whether commit `seq` with this metadata can serve `reader`.
    fn check(&self, seq: u64, info: &PluginInfo, reader: Reader<'_>) -> Result<(), String> {
        if self.plugin != info.name {
            let (theirs, ours) =
                (format!("{} {}", self.plugin, self.plugin_version), format!("{} {}", info.name, info.version));
            return Err(match reader {
                Reader::Training { .. } => {
                    format!("checkpoint {seq} was written by plugin {theirs}, this run uses {ours}")
                }
                Reader::Evaluation => format!("checkpoint {seq} was written by plugin {theirs}, not by {ours}"),
            });
        }
        let Reader::Training { workers, run_config } = reader else { return Ok(()) };
        if self.workers != workers {
            return Err(format!(
                "checkpoint {seq} was written by {} worker(s), this run has {workers}; an exact resume needs the same \
                 cluster size",
                self.workers
            ));
        }
        let ours: serde_json::Value = serde_json::from_str(run_config).expect("canonical JSON of our own");
        if self.run_config != ours {
            return Err(format!(
                "checkpoint {seq} was written with another run configuration: {} in the checkpoint, {} in this run",
                self.run_config, ours
            ));
        }
        Ok(())
    }
}
