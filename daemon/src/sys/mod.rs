//! The machine the daemon runs on: its accelerators ([`accel`]), its CPU's kernel set ([`cpu`])
//! and files written atomically ([`atomic`]).

pub mod accel;
pub(crate) mod atomic;
pub(crate) mod cpu;
