//! What trainerd's test suites share, in one place (`publish = false`: tests only):
//!
//! - [`paths`]: the workspace's built `trainerd` and plugins, and the dataset;
//! - [`ports`]: free loopback ports, and TF_CONFIG on them;
//! - [`s3`]: a real S3-compatible server on loopback; [`proxy`]: a link to it a test cuts;
//!   [`fault`]: a store wrapper that fails writes on request;
//! - [`notify`]: a socket standing in for systemd's notification socket;
//! - [`run`]: the flags of a `trainerd run`, built in one place for every test;
//! - [`cluster`]: real `trainerd run` processes under the daemon's own supervisor (systemd's
//!   semantics), what they print and the events they emit, and one process watched alone;
//! - [`held`]: a return staged at fixed steps, whatever the build's speed;
//! - [`output`]: reading what a finished command printed and wrote.
//!
//! What the product shares with the tests (the supervisor, the events, the exit statuses) lives
//! in the daemon; this kit only drives it.

pub mod cluster;
pub mod fault;
pub mod held;
pub mod netns;
pub mod notify;
pub mod output;
pub mod paths;
pub mod ports;
pub mod proxy;
pub mod run;
pub mod s3;

pub use cluster::{Cluster, Entry, What, Worker};
pub use held::Return;
pub use netns::Netns;
pub use paths::{copy_tree, dataset, parquet_dataset, plugin, python, python_examples, tokens, trainerd, trainerd_cmd};
pub use ports::{free_ports, tf_config};
pub use run::RunArgs;
pub use trainerd_supervise::events::{self, Event};
pub use trainerd_supervise::exit::Exit;
