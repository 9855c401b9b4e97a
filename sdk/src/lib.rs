//! trainerd's plugin SDK: what a model plugin implements and how it is exported.
//!
//! A plugin is a `cdylib` crate that implements [`Model`] and calls [`export_plugin!`] once:
//!
//! ```ignore
//! use trainerd_sdk::{export_plugin, Model};
//! struct MyModel { /* layers */ }
//! impl Model for MyModel { /* info, new, forward, load_data, input_pipeline; loss, metrics, arguments */ }
//! export_plugin!(MyModel);
//! ```
//!
//! The daemon checks the exported header (ABI version, sdk, tch and libtorch versions, target,
//! panic strategy) before it calls anything, so a plugin built against another libtorch is
//! refused with an error saying what to rebuild. Plugins must be built with `panic = "unwind"`
//! (the default): panics are caught inside the plugin and returned as errors.
//!
//! [`mnist`] reads MNIST-format datasets and [`data`] gives the per-epoch order and the
//! TensorFlow-style sharding that input pipelines use. [`columns`] declares how a record of a
//! columnar dataset (Parquet) becomes tensors, for datasets the daemon reads itself.

pub mod abi;
pub mod args;
pub mod batch;
pub mod columns;
pub mod data;
pub mod error;
#[doc(hidden)]
pub mod export;
mod inflated;
pub mod mnist;
pub mod model;
pub mod training;

pub use args::{ArgError, ArgSpec, PluginArgs};
pub use batch::{Batch, ATTENTION_MASK, LABEL};
pub use columns::{Column, Columns, DeclarationError, Decode, Side};
pub use error::PluginError;
pub use model::{InputContext, Model, Pipeline, PluginInfo, Split};
pub use tch;
pub use training::{DecayShape, KerasOptimizer, KerasRule, LrSchedule, NoDecay, OptimizerConfig, TrainDefaults};
