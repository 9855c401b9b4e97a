//! What a plugin author implements ([`Model`]) and the plugin's identity and training defaults
//! ([`PluginInfo`]); the optimizer and schedule settings are [`crate::training`]'s.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

pub use crate::abi::InputContext;
use crate::args::{ArgSpec, PluginArgs};
use crate::batch::Batch;
use crate::columns::Columns;
pub use crate::error::PluginError;
use crate::training::{LrSchedule, OptimizerConfig, TrainDefaults};

/// A dataset split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training examples.
    Train,
    /// Held-out test examples.
    Test,
}

/// An input pipeline: one epoch of a known number of batches, from its first step on.
pub struct Pipeline {
    /// How many batches the whole epoch has.
    pub steps: u64,
    /// The step of the first batch `batches` yields: [`InputContext::first_step`] when the
    /// pipeline starts there itself, 0 when it always starts at the epoch's beginning (the SDK then
    /// skips to the first step by drawing the batches before it).
    pub first_step: u64,
    /// The batches.
    pub batches: Box<dyn Iterator<Item = Result<Batch, PluginError>> + Send>,
}

/// A model plugin. Build the crate as a `cdylib` and call [`crate::export_plugin!`] once.
pub trait Model: Sized + 'static {
    /// A loaded split of the dataset, shared by the pipelines opened over it.
    type Data: 'static;

    /// The keys it accepts as `--plugin-arg KEY=VALUE`. Default: none. A key outside these is
    /// refused before [`Model::info`] or [`Model::new`] sees the arguments.
    fn arguments() -> Vec<ArgSpec> {
        Vec::new()
    }

    /// Identity and defaults, given the run's arguments. A bad value is refused here, with a
    /// message naming the key and what it accepts ([`PluginArgs::parsed`] writes one).
    fn info(args: &PluginArgs) -> Result<PluginInfo, PluginError>;

    /// Builds the model, declaring every parameter under `root` (the VarStore path the daemon
    /// hands over): trainable ones as trainable variables, state such as BatchNorm's running
    /// statistics as variables that require no gradient. The daemon seeds libtorch's generator
    /// before this, so initial values are reproducible.
    fn new(root: &nn::Path, args: &PluginArgs) -> Result<Self, PluginError>;

    /// The model's outputs for a batch (logits, for a classifier), from the columns it reads
    /// ([`Batch::input`] when it has one input). `train` is false during evaluation and
    /// prediction (for dropout and the like).
    fn forward(&self, batch: &Batch, train: bool) -> Result<Tensor, PluginError>;

    /// Mean loss over the batch, from the outputs of [`Model::forward`]. Default: softmax
    /// cross-entropy against the integer labels (column [`crate::batch::LABEL`]).
    fn loss(&self, outputs: &Tensor, batch: &Batch) -> Result<Tensor, PluginError> {
        Ok(outputs.f_log_softmax(-1, Kind::Float)?.f_nll_loss::<Tensor>(
            batch.label()?,
            None,
            tch::Reduction::Mean,
            -100,
        )?)
    }

    /// Per-batch sums of each metric in [`PluginInfo::metrics`], as a 1-D float64 tensor; the
    /// daemon divides by the number of examples. Default: the count of correct argmax
    /// predictions (accuracy).
    fn metrics(&self, outputs: &Tensor, batch: &Batch) -> Result<Tensor, PluginError> {
        let correct = outputs.f_argmax(-1, false)?.f_eq_tensor(batch.label()?)?;
        Ok(correct.f_sum(Kind::Double)?.f_reshape([1])?)
    }

    /// One training or evaluation step's mean loss and metric sums (the daemon computes
    /// gradients from the loss). Default: [`Model::forward`], [`Model::loss`] of its outputs, and
    /// [`Model::metrics`] of its outputs detached. A model whose loss runs its own forward pass
    /// (a Python model file's `loss(module, batch)`) computes them together here.
    fn step(&self, batch: &Batch, train: bool) -> Result<(Tensor, Tensor), PluginError> {
        let outputs = self.forward(batch, train)?;
        let loss = self.loss(&outputs, batch)?;
        let metrics = self.metrics(&outputs.detach(), batch)?;
        Ok((loss, metrics))
    }

    /// What `trainerd predict` writes for each example of a batch (first dimension: examples).
    /// Default: the outputs of [`Model::forward`] in evaluation mode.
    fn predict(&self, batch: &Batch) -> Result<Tensor, PluginError> {
        self.forward(batch, false)
    }

    /// Loads one split from the data directory (the plugin's own format; a columnar dataset is
    /// read by the daemon, as [`PluginInfo::columns`] declares).
    fn load_data(&self, dir: &Path, split: Split) -> Result<Self::Data, PluginError>;

    /// The batches for one epoch of one pipeline, as `distribute_datasets_from_function` would
    /// produce them from `ctx`, from `ctx.first_step` on (or from the epoch's start, with
    /// [`Pipeline::first_step`] 0).
    fn input_pipeline(&self, data: &Arc<Self::Data>, ctx: &InputContext) -> Result<Pipeline, PluginError>;
}

/// A plugin's identity and the defaults it trains with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PluginInfo {
    /// Short name, e.g. `mnist-cnn`.
    pub name: String,
    /// The plugin's own version (its crate version).
    pub version: String,
    /// One line for `plugin check`.
    pub description: String,
    /// Names of the metrics [`Model::metrics`] returns, in order.
    pub metrics: Vec<String>,
    /// Training defaults.
    pub defaults: TrainDefaults,
    /// The columns it trains on when `--data` is a columnar dataset (Parquet); `None` for a plugin
    /// that reads only its own format (through [`Model::load_data`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Columns>,
    /// What, beyond its name and version, makes this model the one it is, as named values (a
    /// TorchScript file's `module_sha256`): every worker must have the same, and a checkpoint is
    /// resumed or evaluated only by a model with its values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub identity: BTreeMap<String, String>,
    /// The loss is a language model's mean cross-entropy per token: the epoch lines show its
    /// perplexity (`exp` of the loss) beside it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub language_model: bool,
    /// The names `trainerd ckpt export` writes, when they are not the variables' own: (name in
    /// the exported file, variable name under the model's path), a variable under several names
    /// when the model shares it (tied weights). A Python model gives its module's `state_dict()`
    /// keys, so that `load_state_dict` takes the export as it is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub export_names: Vec<(String, String)>,
    /// The parameters AdamW leaves undecayed, when not those of fewer than 2 dimensions: each
    /// whose name (under the model) contains one of these (`["bias", "norm"]`). Empty: the
    /// dimension rule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_decay: Vec<String>,
    /// The rows of the model's token embedding, when it has one (a language model): a run whose
    /// tokenizer has more ids is refused at start, naming both sizes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u64>,
}

impl PluginInfo {
    /// An image classifier's identity with the tutorials' defaults: `accuracy` as its metric, 3
    /// epochs, batch 64 per worker, Adam at 1e-3, a constant rate.
    pub fn classifier(name: &str, version: &str, description: &str) -> PluginInfo {
        PluginInfo {
            name: name.into(),
            version: version.into(),
            description: description.into(),
            metrics: vec!["accuracy".into()],
            defaults: TrainDefaults {
                epochs: 3,
                batch_size: 64,
                optimizer: OptimizerConfig::adam(1e-3),
                schedule: LrSchedule::Constant,
            },
            columns: None,
            identity: BTreeMap::new(),
            language_model: false,
            export_names: Vec::new(),
            no_decay: Vec::new(),
            vocab_size: None,
        }
    }

    /// The same identity, training on `columns` from a columnar dataset.
    pub fn with_columns(mut self, columns: Columns) -> PluginInfo {
        self.columns = Some(columns);
        self
    }
}
