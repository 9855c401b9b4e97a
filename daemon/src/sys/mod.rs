//! The machine the daemon runs on: its accelerators ([`accel`]) and files written atomically
//! ([`atomic`]).

pub mod accel;
pub(crate) mod atomic;
