//! trainerd, the training daemon: loads a model plugin (see `trainerd-sdk`) and trains it with
//! libtorch. The binary (`main.rs`) is a thin command line over these modules.

pub mod check;
pub mod config;
pub mod optim;
pub mod plugin;
pub mod progress;
pub mod schedule;
pub mod train;
