//! trainerd, the training daemon: loads a model plugin (see `trainerd-sdk`) and trains it with
//! libtorch, on one worker or with synchronous data parallelism across a TF_CONFIG cluster.
//! The binary (`main.rs`) only calls [`cli::main`]. `docs/architecture.md` draws the modules and
//! which way their dependencies run.

pub mod auth;
pub mod checkpoint;
pub mod cli;
pub mod cluster;
pub mod collective;
pub mod input;
pub mod ops;
pub mod optim;
pub mod plugin;
pub mod state;
pub mod sys;
pub mod train;

pub use trainerd_supervise::supervisor as supervise;
pub use trainerd_supervise::{events, exit};
