//! How a model trains, as plain data both sides exchange: the defaults a plugin names
//! ([`TrainDefaults`]), the optimizer and its hyper-parameters ([`OptimizerConfig`]), which
//! parameters AdamW leaves undecayed ([`NoDecay`]), and the learning-rate schedule
//! ([`LrSchedule`]).
//!
//! The daemon owns the optimizer and the schedule; a plugin only names its defaults, and the
//! operator may override them by flag.

use serde::{Deserialize, Serialize};

/// Defaults the operator may override by flag.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainDefaults {
    /// Epochs.
    pub epochs: u32,
    /// Per-worker batch size.
    pub batch_size: u32,
    /// Optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
}

/// An optimizer and its hyper-parameters, with PyTorch's meaning and defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// Stochastic gradient descent, optionally with (Nesterov) momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0 disables).
        momentum: f64,
        /// Dampening for momentum.
        dampening: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam (Kingma & Ba), L2 weight decay as in `torch.optim.Adam`.
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the second moment.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// AdamW (Loshchilov & Hutter), as `torch.optim.AdamW`: each decayed parameter shrinks by
    /// `lr * weight_decay` of itself, then Adam's update runs without L2.
    Adamw {
        /// Learning rate.
        lr: f64,
        /// Decay of the first moment.
        beta1: f64,
        /// Decay of the second moment.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// Decoupled weight decay of the decayed group.
        weight_decay: f64,
        /// The parameters that do not decay.
        no_decay: NoDecay,
    },
    /// RMSprop, as `torch.optim.RMSprop`.
    Rmsprop {
        /// Learning rate.
        lr: f64,
        /// Smoothing constant.
        alpha: f64,
        /// Added to the denominator.
        eps: f64,
        /// Momentum factor (0 disables).
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Normalise by the estimated variance of the gradient.
        centered: bool,
    },
}

/// Which parameters AdamW does not decay: the second of its two groups.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoDecay {
    /// Those of fewer than 2 dimensions: biases and normalisation weights (nanoGPT's and
    /// torchtitan's rule).
    #[default]
    UnderTwoDims,
    /// Those whose name (under the model, as `named_parameters()` gives it) contains one of these,
    /// as Hugging Face's `no_decay = ["bias", "LayerNorm.weight"]` matches.
    Names(Vec<String>),
    /// None: every parameter decays.
    Nothing,
}

impl NoDecay {
    /// Whether the parameter `name` of `dims` dimensions is left undecayed.
    pub fn exempts(&self, name: &str, dims: usize) -> bool {
        match self {
            NoDecay::UnderTwoDims => dims < 2,
            NoDecay::Names(parts) => parts.iter().any(|p| name.contains(p.as_str())),
            NoDecay::Nothing => false,
        }
    }
}

impl OptimizerConfig {
    /// PyTorch's defaults for SGD (it has no default learning rate; 0.01 is Keras's).
    pub fn sgd(lr: f64) -> Self {
        OptimizerConfig::Sgd { lr, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }

    /// PyTorch's defaults for Adam.
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    /// PyTorch's defaults for AdamW (weight decay 0.01), parameters of fewer than 2 dimensions
    /// undecayed.
    pub fn adamw(lr: f64) -> Self {
        OptimizerConfig::Adamw {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            no_decay: NoDecay::default(),
        }
    }

    /// PyTorch's defaults for RMSprop.
    pub fn rmsprop(lr: f64) -> Self {
        OptimizerConfig::Rmsprop { lr, alpha: 0.99, eps: 1e-8, momentum: 0.0, weight_decay: 0.0, centered: false }
    }

    /// Lower-case name: `sgd`, `adam`, `adamw` or `rmsprop`.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd { .. } => "sgd",
            OptimizerConfig::Adam { .. } => "adam",
            OptimizerConfig::Adamw { .. } => "adamw",
            OptimizerConfig::Rmsprop { .. } => "rmsprop",
        }
    }

    /// Base learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. }
            | OptimizerConfig::Adam { lr, .. }
            | OptimizerConfig::Adamw { lr, .. }
            | OptimizerConfig::Rmsprop { lr, .. } => lr,
        }
    }
}

/// How the learning rate moves with the global step (a pure function of the step, so resuming
/// at step `s` needs only `s`). A warmup, when the run has one, comes first (the daemon's
/// `--warmup-steps`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LrSchedule {
    /// The base rate throughout.
    Constant,
    /// Multiply by `gamma` every `every` steps.
    Step {
        /// Steps between decays.
        every: u64,
        /// Factor per decay.
        gamma: f64,
    },
    /// Multiply by `gamma` each step.
    Exponential {
        /// Factor per step.
        gamma: f64,
    },
    /// Half a cosine from the base rate down to `min_lr`, over the steps after the warmup.
    Cosine {
        /// The floor.
        min_lr: f64,
    },
    /// A straight line from the base rate down to 0 at the end of the run.
    Linear,
    /// Warmup-stable-decay: the base rate, then a decay over the run's last `decay` fraction of
    /// steps, down to `min_lr_ratio` of the base rate.
    Wsd {
        /// The fraction of the run's steps that decay (0 to 1).
        decay: f64,
        /// The floor, as a fraction of the base rate.
        min_lr_ratio: f64,
        /// The decay's shape.
        shape: DecayShape,
    },
}

/// The shape of a warmup-stable-decay schedule's decay (Hugging Face's `decay_type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayShape {
    /// Half a cosine (Hugging Face's default).
    #[default]
    Cosine,
    /// A straight line (torchtitan's default).
    Linear,
    /// `1 - sqrt(progress)` (Hugging Face's `1-sqrt`).
    Sqrt,
}
