//! The machine the daemon runs on: its accelerators ([`accel`]), its CPU's kernel set ([`cpu`]),
//! files written atomically ([`atomic`]), what autograd owns ([`autograd`]: a gradient, and the
//! moment it is final) and the C++ shims' boundary ([`shim`]).

pub mod accel;
pub(crate) mod atomic;
pub(crate) mod autograd;
pub(crate) mod cpu;
pub(crate) mod shim;
