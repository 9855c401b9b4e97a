//! The step's mathematics: the optimizers ([`optimizer`]) and their settings from the flags
//! ([`flags`]), learning-rate schedules ([`schedule`]), gradient clipping ([`clip`]), mixed
//! precision ([`precision`]) and the epoch-end callbacks ([`callbacks`]).

pub mod callbacks;
pub mod clip;
pub mod flags;
pub mod optimizer;
pub mod precision;
pub mod schedule;
