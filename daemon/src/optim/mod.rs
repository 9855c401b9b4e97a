//! The step's mathematics: the optimizers ([`optimizer`]) and their settings from the flags
//! ([`flags`]), learning-rate schedules ([`schedule`]), gradient clipping ([`clip`]), mixed
//! precision ([`precision`]), the epoch-end callbacks ([`callbacks`]), and the optimizer state
//! of the ranges a member owns under `--shard-optimizer` ([`sharded_state`]).

mod adam;
pub(crate) mod callbacks;
pub mod clip;
pub(crate) mod elementwise;
#[cfg(test)]
mod elementwise_tests;
pub(crate) mod flags;
pub(crate) mod lanes;
pub(crate) mod optimizer;
pub(crate) mod precision;
pub(crate) mod schedule;
pub(crate) mod sharded_state;

/// A flag of the step's mathematics whose value cannot be used: each names the flag, what it was
/// given, and what it takes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub(crate) enum FlagError {
    /// A value not of the flag's form.
    #[error("{flag} {text}: expected {expected}")]
    Form {
        /// The flag.
        flag: &'static str,
        /// What it was given.
        text: String,
        /// The form it takes.
        expected: &'static str,
    },
    /// A part of the value that does not read as what it must be.
    #[error("{flag} {text}: {part} {value:?} is not {what}")]
    Part {
        /// The flag.
        flag: &'static str,
        /// What it was given.
        text: String,
        /// The part (`GAMMA`).
        part: &'static str,
        /// Its text.
        value: String,
        /// What it must be ("a number").
        what: &'static str,
    },
    /// A figure the run does not have.
    #[error("{flag} {text}: no figure named {metric}; this run has {}", names.join(", "))]
    NoFigure {
        /// The flag.
        flag: &'static str,
        /// What it was given.
        text: String,
        /// The figure named.
        metric: String,
        /// The figures the run has.
        names: Vec<String>,
    },
    /// A flag of another optimizer's.
    #[error("{flag} does not apply to optimizer {optimizer}")]
    Inapplicable {
        /// The flag.
        flag: &'static str,
        /// The run's optimizer.
        optimizer: &'static str,
    },
    /// Nesterov momentum without momentum.
    #[error("--nesterov needs --momentum greater than 0")]
    NesterovWithoutMomentum,
    /// Float16 asked for on a device without it.
    #[error(
        "--precision fp16 needs CUDA: float16 with loss scaling is for GPUs' tensor cores; train with --precision \
         bf16 on the CPU"
    )]
    Fp16OnCpu,
}
