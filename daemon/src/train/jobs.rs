//! What `trainerd evaluate` and `trainerd predict` are asked to do: read by the commands
//! ([`super::evaluate`], [`super::predict`]) and by what every member of their cluster must
//! agree on ([`super::agreement`]).

use std::path::PathBuf;

use tch::Device;
use trainerd_sdk::Split;
use trainerd_storage::{Location, S3Options};

use crate::cluster::{ClusterConfig, Network, Timeouts};
use crate::input::DataSource;

/// What to evaluate and where.
#[derive(Clone, Debug)]
pub(crate) struct EvalConfig {
    /// The data: the plugin's own format, or a columnar dataset.
    pub(crate) data: DataSource,
    /// The plugin's configuration every worker must share ([`crate::plugin::Plugin::agreement`]).
    pub(crate) plugin: Option<serde_json::Value>,
    /// The forward pass's precision.
    pub(crate) precision: crate::optim::precision::Precision,
    /// Where the checkpoints are.
    pub(crate) location: Location,
    /// S3 settings beyond the AWS variables.
    pub(crate) s3: S3Options,
    /// The commit to evaluate (default: the newest that verifies).
    pub(crate) sequence: Option<u64>,
    /// Per-worker batch size.
    pub(crate) batch_size: u32,
    /// Where the model lives.
    pub(crate) device: Device,
    /// libtorch intra-op threads.
    pub(crate) threads: usize,
    /// The cluster, or `None` to evaluate alone.
    pub(crate) cluster: Option<ClusterConfig>,
    /// Where the cluster's listeners bind, and its secret.
    pub(crate) network: Network,
    /// The cluster's deadlines.
    pub(crate) timeouts: Timeouts,
}

/// What to predict and where to write it.
#[derive(Clone, Debug)]
pub(crate) struct PredictConfig {
    /// The checkpoint, the data and the cluster, as an evaluation has them.
    pub(crate) eval: EvalConfig,
    /// The split whose examples are predicted.
    pub(crate) split: Split,
    /// The Parquet file to write (each member of a cluster writes its own, named from it).
    pub(crate) output: PathBuf,
}
