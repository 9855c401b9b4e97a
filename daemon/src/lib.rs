//! trainerd, the training daemon: loads a model plugin (see `trainerd-sdk`) and trains it with
//! libtorch, on one worker or with synchronous data parallelism across a TF_CONFIG cluster.
//! The binary (`main.rs`) is a thin command line over these modules.

pub mod accel;
pub mod atomic;
pub mod check;
pub mod checkpoint;
pub mod ckpt;
pub mod cluster;
pub mod collective;
pub mod config;
pub mod evaluate;
pub mod local;
pub mod ops;
pub mod optim;
pub mod plugin;
pub mod progress;
pub mod schedule;
pub mod tensorboard;
pub mod train;
pub mod trust;
