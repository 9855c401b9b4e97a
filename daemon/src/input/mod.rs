//! The run's data, whichever kind `--data` names, behind one interface for training and
//! evaluation (the steps of an epoch, and batches from any (epoch, step) on):
//! - a directory in the plugin's own format (MNIST's idx files), read by the plugin through the
//!   ABI, one epoch's pipeline at a time;
//! - a columnar dataset (Parquet in Hugging Face's layout, on a directory or S3), read by
//!   `trainerd-data` for the columns the plugin declares, in a stream that runs across epochs;
//! - raw text of such a dataset, for a model that declares a `text` column: tokenized and packed
//!   into blocks before the cluster forms ([`text`]).
//!
//! A columnar dataset is opened before the cluster forms: its fingerprint and the shuffle window
//! are part of what every worker must agree on, and of every checkpoint's run configuration.
//!
//! [`source`] is what `--data` names, opened before the cluster forms; [`data`] is the loaded
//! data of a model and its batches from any (epoch, step) on.

pub(crate) mod data;
pub(crate) mod source;
pub(crate) mod text;

pub(crate) use data::{Batch, Data, Epochs, ExampleId};
pub(crate) use source::{DataFigures, DataSource, Files, Watch};

use crate::plugin::CallError;

/// Why the data cannot be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum InputError {
    /// The columnar dataset failed.
    #[error(transparent)]
    Data(#[from] trainerd_data::DataError),
    /// The plugin's own reader failed.
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// A columnar dataset for a plugin that declares no columns.
    #[error(
        "plugin {plugin} declares no columns, so it cannot train on the Parquet dataset at {location}: it reads only \
         its own format from a directory (rebuild it declaring PluginInfo::columns)"
    )]
    NoColumns {
        /// The plugin.
        plugin: String,
        /// The dataset.
        location: String,
    },
    /// A shuffle window of no rows.
    #[error("--shuffle-window 0: expected at least 1 row")]
    NoWindow,
    /// A tokenizer with ids beyond the model's embedding.
    #[error(
        "tokenizer {tokenizer} has {ids} ids, more than the {rows} rows of the token embedding of plugin {plugin}'s \
         model: its ids past {rows} would index outside it (give the model a vocabulary of at least {ids}, or use its \
         own tokenizer)"
    )]
    VocabularyTooLarge {
        /// The tokenizer.
        tokenizer: String,
        /// Its ids (one more than its largest).
        ids: u64,
        /// The plugin.
        plugin: String,
        /// The model's embedding rows.
        rows: u64,
    },
    /// An evaluation asked of a run that does not evaluate (a bug).
    #[error("no test split was opened: this run does not evaluate")]
    NoEvaluation,
    /// Nothing to evaluate on, and evaluation not turned off.
    #[error(
        "data location {location}: no test or validation split (test-00000-of-0000N.parquet or validation-…): every \
         epoch ends with an evaluation on it; give --no-evaluation to train without one"
    )]
    NoTestSplit {
        /// The dataset.
        location: String,
    },
}
