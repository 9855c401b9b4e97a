//! trainerd, the training daemon: loads a model plugin (see `trainerd-sdk`) and trains it with
//! libtorch, on one worker or with synchronous data parallelism across a TF_CONFIG cluster.
//! The binary (`main.rs`) only calls [`cli::main`]. `docs/architecture.md` draws the modules and
//! which way their dependencies run.

pub mod accel;
pub mod atomic;
pub mod auth;
pub mod callbacks;
pub mod check;
pub mod checkpoint;
pub mod ckpt;
pub mod cli;
pub mod clip;
pub mod cluster;
pub mod collective;
pub mod config;
pub mod evaluate;
pub mod input;
pub mod local;
pub mod ops;
pub mod optim;
pub mod plugin;
pub mod precision;
pub mod progress;
pub mod schedule;
pub mod state;
pub mod tensorboard;
pub mod train;
pub mod trust;

pub use trainerd_supervise::supervisor as supervise;
pub use trainerd_supervise::{events, exit};
