//! What the daemon tells the outside: the terminal ([`progress`]: Keras-style epoch and step
//! lines, a bar on a TTY), the journal ([`log`]), systemd ([`notify`]: readiness, status,
//! watchdog, stopping), Prometheus ([`serve`]: `/metrics` and `/healthz`) and TensorBoard
//! ([`tensorboard`]: event files). The training loop reports into one [`Telemetry`]
//! ([`telemetry`]); systemd, Prometheus and the journal read it.

pub mod log;
pub mod notify;
pub mod progress;
pub mod serve;
pub mod telemetry;
pub mod tensorboard;

pub use telemetry::Telemetry;
