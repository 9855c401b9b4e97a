//! The machine the daemon runs on: its accelerators ([`accel`]), its CPU's kernel set ([`cpu`]),
//! files written atomically ([`atomic`]) and what autograd owns ([`autograd`]: a gradient, and the moment it is final).

pub mod accel;
pub(crate) mod atomic;
pub(crate) mod autograd;
pub(crate) mod cpu;
