//! Checkpoints as the daemon sees them: the coordinator's background commits ([`checkpointer`])
//! and what `trainerd ckpt` shows of a location ([`inspect`]).

pub mod checkpointer;
pub mod inspect;

pub use checkpointer::{Checkpointer, Finished};
