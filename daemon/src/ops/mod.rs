//! What the daemon tells the outside: the terminal ([`progress`]: Keras-style epoch and step
//! lines, a bar on a TTY), the journal ([`log`]), systemd ([`notify`]: readiness, status,
//! watchdog, stopping), Prometheus ([`serve`]: `/metrics` and `/healthz`) and TensorBoard
//! ([`tensorboard`]: event files). The training loop reports into one [`Telemetry`]
//! ([`telemetry`]); systemd, Prometheus and the journal read it.

pub(crate) mod log;
pub(crate) mod notify;
pub(crate) mod progress;
pub(crate) mod serve;
pub(crate) mod telemetry;
pub(crate) mod tensorboard;

pub(crate) use telemetry::Telemetry;
