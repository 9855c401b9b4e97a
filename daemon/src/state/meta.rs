//! A trainerd checkpoint's metadata (the manifest's `meta`): where training stood, and what must
//! match to continue from it. [`Meta::read`] and the checks are the one place that decides
//! whether a commit belongs to a run, for training (which resumes it) and evaluation (which only
//! needs the same model).

use serde::{Deserialize, Serialize};
use trainerd_sdk::PluginInfo;
use trainerd_storage::Restored;

use super::position::{Position, RNG_SCHEME};

/// Why a commit cannot serve a reader.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MetaError {
    /// Its metadata is not a trainerd checkpoint's of this version.
    #[error("checkpoint {sequence} was not written by this version of trainerd: {source}")]
    Unreadable {
        /// The commit.
        sequence: u64,
        /// Why its metadata does not read.
        source: serde_json::Error,
    },
    /// It belongs to another run.
    #[error(transparent)]
    Mismatch(#[from] Mismatch),
}

/// How a commit differs from what its reader needs.
#[derive(Debug, thiserror::Error, PartialEq)]
pub(crate) enum Mismatch {
    /// A run resumes a commit of another plugin.
    #[error("checkpoint {sequence} was written by plugin {theirs}, this run uses {ours}")]
    PluginOfRun {
        /// The commit.
        sequence: u64,
        /// Its plugin, name and version.
        theirs: String,
        /// The run's.
        ours: String,
    },
    /// An evaluation of a commit of another plugin.
    #[error("checkpoint {sequence} was written by plugin {theirs}, not by {ours}")]
    PluginOfEvaluation {
        /// The commit.
        sequence: u64,
        /// Its plugin, name and version.
        theirs: String,
        /// The evaluation's.
        ours: String,
    },
    /// The same plugin, another model (a TorchScript file's sha256).
    #[error("checkpoint {sequence} was written by another model of plugin {plugin}: {differences}")]
    Model {
        /// The commit.
        sequence: u64,
        /// The plugin.
        plugin: String,
        /// The identity values that differ.
        differences: Differences,
    },
    /// Another run configuration.
    #[error("checkpoint {sequence} was written with another run configuration: {differences}")]
    Configuration {
        /// The commit.
        sequence: u64,
        /// The keys that differ.
        differences: Differences,
    },
    /// Another worker count with another global batch.
    #[error(
        "checkpoint {sequence} was written by {theirs_workers} worker(s) with batch {theirs_batch} each (global batch \
         {}); this run has {ours_workers} worker(s) with batch {ours_batch} (global batch {}): a resume with another \
         worker count needs the same global batch ({})",
        .theirs_batch * *.theirs_workers as u64,
        .ours_batch * *.ours_workers as u64,
        global_batch_hint(.theirs_batch * *.theirs_workers as u64, *.ours_workers)
    )]
    GlobalBatch {
        /// The commit.
        sequence: u64,
        /// Its workers (slots).
        theirs_workers: usize,
        /// Its batch per worker.
        theirs_batch: u64,
        /// This run's workers.
        ours_workers: usize,
        /// This run's batch per worker.
        ours_batch: u64,
    },
}

/// What a run on `workers` workers should give to continue a global batch of `global`.
fn global_batch_hint(global: u64, workers: usize) -> String {
    if global.is_multiple_of(workers as u64) {
        format!("give --batch-size {}", global / workers as u64)
    } else {
        format!("{global} examples do not divide among {workers} workers")
    }
}

/// A key whose value differs between a commit's run configuration and its reader's.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Difference {
    /// The key, nested keys dotted (`data.fingerprint`).
    pub(crate) key: String,
    /// Its value in the commit (`"absent"` when it lacks the key).
    pub(crate) theirs: serde_json::Value,
    /// Its value for the reader.
    pub(crate) ours: serde_json::Value,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is {} in the checkpoint, {} in this run", self.key, self.theirs, self.ours)
    }
}

/// Every key that differs, told one after the other.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Differences(pub(crate) Vec<Difference>);

impl std::fmt::Display for Differences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let told: Vec<String> = self.0.iter().map(Difference::to_string).collect();
        f.write_str(&told.join("; "))
    }
}

/// The manifest metadata of a trainerd checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Meta {
    /// Position.
    pub(crate) position: Position,
    /// Plugin name.
    pub(crate) plugin: String,
    /// Plugin version.
    pub(crate) plugin_version: String,
    /// Slots that trained: the workers, times the replicas of each (`--devices`).
    pub(crate) workers: usize,
    /// Everything that must agree to continue exactly (the run configuration as the cluster
    /// checks it).
    pub(crate) run_config: serde_json::Value,
    /// How the RNG continues.
    pub(crate) rng: String,
    /// The names `ckpt export` writes, when the plugin gives them ([`PluginInfo::export_names`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) export_names: Vec<(String, String)>,
    /// The ranks of the generation that committed it (none in commits made before the field):
    /// after every process restarted, a rank it left out was already gone, and is not waited
    /// for (docs/fault-tolerance.md, "Going on at once").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) members: Vec<usize>,
    /// TF_CONFIG's worker count then: the ranks mean the same workers only in a cluster of that
    /// size (a job started again with another count waits for everyone).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) cluster_workers: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The run configuration's key for the replicas of each worker (`--devices`). The math depends on
/// the slot count (a checkpoint's `workers`), not on how its slots are spread over processes, so a
/// resume does not compare it: one daemon of two replicas continues two daemons' commit exactly.
pub(crate) const REPLICAS_KEY: &str = "replicas_per_worker";

/// The run configuration's key for the micro-batches of each update (`--accumulate`): slots too,
/// so not compared on resume either.
pub(crate) const ACCUMULATE_KEY: &str = "accumulate";

/// The run configuration's key for the plugin's configuration: its model's identity values
/// (`identity`, compared by evaluation too) and its agreed arguments (`args`).
pub(crate) const PLUGIN_KEY: &str = "plugin";

/// The run configuration's key for when the members compare their states
/// (`--replica-check-every`): it does not change the math, so a resume does not compare it.
pub(crate) const REPLICA_CHECK_KEY: &str = "replica_check";

/// The run configuration's key for the GPU model of each device (CUDA runs): a resume on
/// another model is refused, naming both, since its kernels round differently. Commits made
/// before the key existed do not have it, and are not compared on it.
pub(crate) const GPU_KEY: &str = "gpus";

/// The run configuration's key for the learning-rate schedule's formulas the daemons compute
/// ([`crate::optim::schedule::FORMULAS`]), present when the schedule moves: daemons that
/// compute other formulas are refused as members of one run. Commits made before the key
/// existed do not have it, and are not compared on it: their run continues with the formulas
/// it started with, which its position records.
pub(crate) const SCHEDULE_VERSION_KEY: &str = "schedule_version";

/// The run configuration's key for the optimizer state sharded over the workers
/// (`--shard-optimizer`): every worker must shard alike, but a commit holds the whole state
/// either way, so a resume does not compare it.
pub(crate) const SHARD_KEY: &str = "shard_optimizer";

/// What a resume does not compare: how the slots are spread (the slot count is compared), when
/// the replicas are compared, and whether the optimizer state is sharded.
const SPREAD: [&str; 4] = [REPLICAS_KEY, ACCUMULATE_KEY, REPLICA_CHECK_KEY, SHARD_KEY];

/// Who reads a checkpoint, which decides what must match and how a mismatch is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reader<'a> {
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
    pub(crate) fn new(position: Position, info: &PluginInfo, workers: usize, run_config: &str) -> Meta {
        Meta {
            position,
            plugin: info.name.clone(),
            plugin_version: info.version.clone(),
            workers,
            run_config: serde_json::from_str(run_config).expect("canonical JSON of our own"),
            rng: RNG_SCHEME.into(),
            export_names: info.export_names.clone(),
            members: Vec::new(),
            cluster_workers: 0,
        }
    }

    /// The metadata of a restored commit, checked for `reader` against `info`'s plugin.
    pub(crate) fn read(restored: &Restored, info: &PluginInfo, reader: Reader<'_>) -> Result<Meta, MetaError> {
        let sequence = restored.record.sequence;
        let meta: Meta = serde_json::from_value(restored.manifest.meta.clone())
            .map_err(|source| MetaError::Unreadable { sequence, source })?;
        meta.check(sequence, info, reader)?;
        Ok(meta)
    }

    /// Whether commit `sequence` with this metadata can serve `reader`.
    fn check(&self, sequence: u64, info: &PluginInfo, reader: Reader<'_>) -> Result<(), Mismatch> {
        if self.plugin != info.name {
            let (theirs, ours) =
                (format!("{} {}", self.plugin, self.plugin_version), format!("{} {}", info.name, info.version));
            return Err(match reader {
                Reader::Training { .. } => Mismatch::PluginOfRun { sequence, theirs, ours },
                Reader::Evaluation => Mismatch::PluginOfEvaluation { sequence, theirs, ours },
            });
        }
        // The model's identity values (a TorchScript file's sha256): the same plugin with another
        // model must not load these tensors, even to evaluate them.
        let absent = |v: serde_json::Value| if v.is_null() { serde_json::Value::String("absent".into()) } else { v };
        let identity = |cfg: &serde_json::Value| absent(cfg[PLUGIN_KEY][crate::plugin::PLUGIN_IDENTITY_KEY].clone());
        let ours = if info.identity.is_empty() {
            absent(serde_json::Value::Null)
        } else {
            serde_json::to_value(&info.identity).expect("strings")
        };
        let theirs = identity(&self.run_config);
        if theirs != ours {
            let key = format!("{PLUGIN_KEY}.{}", crate::plugin::PLUGIN_IDENTITY_KEY);
            let differences = Differences(differences(&key, &theirs, &ours));
            return Err(Mismatch::Model { sequence, plugin: info.name.clone(), differences });
        }
        let Reader::Training { workers, run_config } = reader else { return Ok(()) };
        let mut ours: serde_json::Value = serde_json::from_str(run_config).expect("canonical JSON of our own");
        for key in [GPU_KEY, SCHEDULE_VERSION_KEY] {
            if self.run_config.get(key).is_none() {
                ours = without(&ours, &[key]);
            }
        }
        let (theirs, ours) = if self.workers == workers {
            (without(&self.run_config, &SPREAD), without(&ours, &SPREAD))
        } else {
            // The data order does not depend on the worker count: another count with the same
            // global batch continues with the same global batches.
            self.same_global_batch(sequence, workers, &ours)?;
            let keys = [REPLICAS_KEY, ACCUMULATE_KEY, REPLICA_CHECK_KEY, SHARD_KEY, "batch_size"];
            (without(&self.run_config, &keys), without(&ours, &keys))
        };
        if theirs != ours {
            return Err(Mismatch::Configuration {
                sequence,
                differences: Differences(differences("", &theirs, &ours)),
            });
        }
        Ok(())
    }

    /// Whether this checkpoint's global batch is that of `workers` workers with `ours`'s batch.
    fn same_global_batch(&self, sequence: u64, workers: usize, ours: &serde_json::Value) -> Result<(), Mismatch> {
        let batch = |cfg: &serde_json::Value| cfg["batch_size"].as_u64().unwrap_or(0);
        let (theirs_batch, ours_batch) = (batch(&self.run_config), batch(ours));
        if theirs_batch * self.workers as u64 == ours_batch * workers as u64 {
            return Ok(());
        }
        Err(Mismatch::GlobalBatch {
            sequence,
            theirs_workers: self.workers,
            theirs_batch,
            ours_workers: workers,
            ours_batch,
        })
    }
}

/// Where two run configurations differ, key by key (nested keys dotted: `data.fingerprint`; a key
/// one of them lacks is "absent").
fn differences(prefix: &str, theirs: &serde_json::Value, ours: &serde_json::Value) -> Vec<Difference> {
    use serde_json::Value;
    match (theirs, ours) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            let absent = Value::String("absent".into());
            keys.into_iter()
                .flat_map(|k| {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    differences(&key, a.get(k).unwrap_or(&absent), b.get(k).unwrap_or(&absent))
                })
                .collect()
        }
        (a, b) if a == b => Vec::new(),
        (a, b) => vec![Difference { key: prefix.to_string(), theirs: a.clone(), ours: b.clone() }],
    }
}

/// A run configuration without `keys`.
fn without(cfg: &serde_json::Value, keys: &[&str]) -> serde_json::Value {
    let mut cfg = cfg.clone();
    if let Some(o) = cfg.as_object_mut() {
        for key in keys {
            o.remove(*key);
        }
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(workers: usize, batch: u32) -> Meta {
        let info = PluginInfo::classifier("linear", "0.1.0", "");
        let cfg = serde_json::json!({"batch_size": batch, "seed": 3, "epochs": 2}).to_string();
        Meta::new(Position::start(1), &info, workers, &cfg)
    }

    fn resume(m: &Meta, workers: usize, batch: u32, seed: u64) -> Result<(), Mismatch> {
        let info = PluginInfo::classifier("linear", "0.1.0", "");
        let cfg = serde_json::json!({"batch_size": batch, "seed": seed, "epochs": 2}).to_string();
        m.check(7, &info, Reader::Training { workers, run_config: &cfg })
    }

    /// A checkpoint of one TorchScript file is neither resumed nor evaluated with another.
    #[test]
    fn another_model_identity_is_refused_naming_both_values() {
        let mut info = PluginInfo::classifier("torchscript", "0.1.0", "");
        info.identity.insert("module_sha256".into(), "aa".into());
        let cfg = serde_json::json!({"batch_size": 8, PLUGIN_KEY: {"identity": {"module_sha256": "aa"}}}).to_string();
        let m = Meta::new(Position::start(1), &info, 1, &cfg);
        assert_eq!(m.check(3, &info, Reader::Evaluation), Ok(()));
        info.identity.insert("module_sha256".into(), "bb".into());
        let ours = serde_json::json!({"batch_size": 8, PLUGIN_KEY: {"identity": {"module_sha256": "bb"}}}).to_string();
        let refused = "checkpoint 3 was written by another model of plugin torchscript: \
                       plugin.identity.module_sha256 is \"aa\" in the checkpoint, \"bb\" in this run";
        assert_eq!(m.check(3, &info, Reader::Evaluation).unwrap_err().to_string(), refused);
        assert_eq!(
            m.check(3, &info, Reader::Training { workers: 1, run_config: &ours }).unwrap_err().to_string(),
            refused
        );
        // A checkpoint from before plugins stated an identity belongs to a plugin that states none.
        let plain = PluginInfo::classifier("linear", "0.1.0", "");
        assert_eq!(meta(1, 8).check(3, &plain, Reader::Evaluation), Ok(()));
    }

    #[test]
    fn a_different_run_configuration_names_each_key_that_differs() {
        let theirs = serde_json::json!({"batch_size": 64, "data": {"fingerprint": "ab", "shuffle_window": 9}});
        let ours = serde_json::json!({"batch_size": 32, "data": {"fingerprint": "cd", "shuffle_window": 9}, "x": 1});
        assert_eq!(
            differences("", &theirs, &ours).iter().map(Difference::to_string).collect::<Vec<_>>(),
            [
                "batch_size is 64 in the checkpoint, 32 in this run",
                "data.fingerprint is \"ab\" in the checkpoint, \"cd\" in this run",
                "x is \"absent\" in the checkpoint, 1 in this run",
            ]
        );
    }

    #[test]
    fn another_worker_count_resumes_with_the_same_global_batch_only() {
        let m = meta(4, 32);
        assert_eq!(resume(&m, 4, 32, 3), Ok(()));
        assert_eq!(resume(&m, 2, 64, 3), Ok(()), "2 x 64 = 4 x 32");
        assert_eq!(resume(&m, 1, 128, 3), Ok(()));
        assert_eq!(
            resume(&m, 2, 32, 3).unwrap_err().to_string(),
            "checkpoint 7 was written by 4 worker(s) with batch 32 each (global batch 128); this run has 2 worker(s) \
             with batch 32 (global batch 64): a resume with another worker count needs the same global batch (give \
             --batch-size 64)"
        );
        assert!(resume(&m, 3, 32, 3)
            .unwrap_err()
            .to_string()
            .ends_with("(128 examples do not divide among 3 workers)"));
        assert_eq!(
            resume(&m, 2, 64, 4).unwrap_err().to_string(),
            "checkpoint 7 was written with another run configuration: seed is 3 in the checkpoint, 4 in this run",
            "the rest of the configuration must still agree"
        );
    }

    /// A daemon's replicas and micro-batches are slots: 1 daemon of 2 replicas, 1 daemon accumulating
    /// 2 and 2 daemons of one are the same run.
    #[test]
    fn the_same_slots_resume_whatever_the_replicas_per_worker() {
        let info = PluginInfo::classifier("linear", "0.1.0", "");
        let two = serde_json::json!({"batch_size": 32, "seed": 3, "epochs": 2, REPLICAS_KEY: 2}).to_string();
        let m = Meta::new(Position::start(1), &info, 2, &two);
        assert_eq!(resume(&m, 2, 32, 3), Ok(()), "2 daemons of one replica");
        assert_eq!(m.check(7, &info, Reader::Training { workers: 2, run_config: &two }), Ok(()));
        assert_eq!(resume(&meta(2, 32), 2, 32, 3), Ok(()));
        let accumulated = serde_json::json!({"batch_size": 32, "seed": 3, "epochs": 2, ACCUMULATE_KEY: 2}).to_string();
        assert_eq!(m.check(7, &info, Reader::Training { workers: 2, run_config: &accumulated }), Ok(()));
        assert_eq!(
            resume(&m, 2, 32, 4).unwrap_err().to_string(),
            "checkpoint 7 was written with another run configuration: seed is 3 in the checkpoint, 4 in this run"
        );
    }
}
