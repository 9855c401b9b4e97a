//! Supervising trainerd workers, the part of the daemon that `trainerd local` and the test suites
//! share: a worker's lifecycle events and the channel they travel on ([`events`]), its exit
//! statuses ([`exit`]), a supervisor with systemd's restart semantics ([`supervisor`]), and a
//! cluster's addresses on loopback ([`loopback`]).
//!
//! It knows nothing of training, libtorch, plugins or storage, so that a supervisor (and a test)
//! links none of them; the daemon re-exports it (`trainerd::events`, `trainerd::exit`,
//! `trainerd::supervise`).

pub mod events;
pub mod exit;
pub mod loopback;
pub mod supervisor;
