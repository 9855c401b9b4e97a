//! trainerd, the training daemon: loads a model plugin (see `trainerd-sdk`) and trains it with
//! libtorch, on one worker or with synchronous data parallelism across a TF_CONFIG cluster.
//! The binary (`main.rs`) only calls [`cli::main`]. `docs/architecture.md` draws the rooms and
//! which way their dependencies run.
//!
//! The crate is private but for what the binary, the benchmarks and the tests use: the command
//! line's entry, the collectives, the machine's accelerators and gradient clipping.

#![warn(unreachable_pub)]

mod auth;
mod checkpoint;
pub mod cli;
mod cluster;
pub mod collective;
mod input;
mod ops;
pub mod optim;
mod plugin;
mod state;
pub mod sys;
mod train;

use trainerd_supervise::supervisor as supervise;
use trainerd_supervise::{events, exit};
