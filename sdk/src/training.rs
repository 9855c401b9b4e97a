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

/// An optimizer and its hyper-parameters, with PyTorch's meaning and defaults, or Keras's.
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
    /// One of Keras's optimizers with Keras's hyper-parameters and update rules: what a Keras
    /// model's `compile(optimizer=...)` named.
    Keras(KerasOptimizer),
}

/// A Keras optimizer (Keras 3's rules, as its PyTorch backend runs them): the gradients clipped
/// (`clipnorm` per variable; `global_clipnorm` or `clipvalue` over all), then each decayed variable
/// shrunk by `lr * weight_decay` of itself (decoupled, on every optimizer), then the rule's update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KerasOptimizer {
    /// The update rule and its own hyper-parameters.
    pub rule: KerasRule,
    /// `learning_rate`.
    pub lr: f64,
    /// `weight_decay` (0: none).
    pub weight_decay: f64,
    /// The variables `exclude_from_weight_decay` exempts, by name under the model.
    #[serde(default)]
    pub no_decay: Vec<String>,
    /// `clipnorm`: each variable's gradient scaled to at most this 2-norm.
    #[serde(default)]
    pub clipnorm: Option<f64>,
    /// `global_clipnorm`: every gradient scaled so that their global 2-norm is at most this.
    #[serde(default)]
    pub global_clipnorm: Option<f64>,
    /// `clipvalue`: every gradient element clamped to [-clipvalue, clipvalue].
    #[serde(default)]
    pub clipvalue: Option<f64>,
}

/// A Keras optimizer's update rule. Where it differs from PyTorch's: SGD's momentum buffer holds
/// `-lr·g` steps (`m = momentum·m - lr·g`); Adam adds epsilon to the uncorrected `√v` (`p -= α·m /
/// (√v + ε)` with `α = lr·√(1-β₂ᵗ)/(1-β₁ᵗ)`); RMSprop adds epsilon under the root (`g·lr /
/// √(v + ε)`). Keras's defaults: epsilon 1e-7, RMSprop's rho 0.9.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum KerasRule {
    /// `keras.optimizers.SGD`.
    Sgd {
        /// `momentum` (0: none).
        momentum: f64,
        /// `nesterov`.
        nesterov: bool,
    },
    /// `keras.optimizers.Adam`.
    Adam {
        /// `beta_1`.
        beta1: f64,
        /// `beta_2`.
        beta2: f64,
        /// `epsilon`.
        eps: f64,
    },
    /// `keras.optimizers.AdamW`: Adam's rule; it differs in its default weight decay (0.004).
    Adamw {
        /// `beta_1`.
        beta1: f64,
        /// `beta_2`.
        beta2: f64,
        /// `epsilon`.
        eps: f64,
    },
    /// `keras.optimizers.RMSprop`.
    Rmsprop {
        /// `rho`.
        rho: f64,
        /// `momentum` (0: none).
        momentum: f64,
        /// `epsilon`.
        eps: f64,
        /// `centered`.
        centered: bool,
    },
}

impl KerasOptimizer {
    /// Keras's defaults for the optimizer `name` (`sgd`, `adam`, `adamw`, `rmsprop`) at rate `lr`.
    pub fn defaults(name: &str, lr: f64) -> Option<KerasOptimizer> {
        let (rule, weight_decay) = match name {
            "sgd" => (KerasRule::Sgd { momentum: 0.0, nesterov: false }, 0.0),
            "adam" => (KerasRule::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-7 }, 0.0),
            "adamw" => (KerasRule::Adamw { beta1: 0.9, beta2: 0.999, eps: 1e-7 }, 0.004),
            "rmsprop" => (KerasRule::Rmsprop { rho: 0.9, momentum: 0.0, eps: 1e-7, centered: false }, 0.0),
            _ => return None,
        };
        Some(KerasOptimizer {
            rule,
            lr,
            weight_decay,
            no_decay: Vec::new(),
            clipnorm: None,
            global_clipnorm: None,
            clipvalue: None,
        })
    }

    /// The rule's lower-case name.
    pub fn name(&self) -> &'static str {
        match self.rule {
            KerasRule::Sgd { .. } => "sgd",
            KerasRule::Adam { .. } => "adam",
            KerasRule::Adamw { .. } => "adamw",
            KerasRule::Rmsprop { .. } => "rmsprop",
        }
    }

    /// Its hyper-parameters under Keras's names, as the start-up line shows them.
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("learning_rate {}", self.lr)];
        match self.rule {
            KerasRule::Sgd { momentum, nesterov } => {
                parts.push(format!("momentum {momentum}"));
                parts.push(format!("nesterov {nesterov}"));
            }
            KerasRule::Adam { beta1, beta2, eps } | KerasRule::Adamw { beta1, beta2, eps } => {
                parts.push(format!("beta_1 {beta1}"));
                parts.push(format!("beta_2 {beta2}"));
                parts.push(format!("epsilon {eps}"));
            }
            KerasRule::Rmsprop { rho, momentum, eps, centered } => {
                parts.push(format!("rho {rho}"));
                parts.push(format!("momentum {momentum}"));
                parts.push(format!("epsilon {eps}"));
                parts.push(format!("centered {centered}"));
            }
        }
        if self.weight_decay != 0.0 {
            let exempt = match self.no_decay.len() {
                0 => " (every variable)".to_string(),
                n => format!(" ({n} variable(s) excluded)"),
            };
            parts.push(format!("weight_decay {}{exempt}", self.weight_decay));
        }
        let clips =
            [("clipnorm", self.clipnorm), ("global_clipnorm", self.global_clipnorm), ("clipvalue", self.clipvalue)];
        parts.extend(clips.iter().filter_map(|(name, v)| v.map(|v| format!("{name} {v}"))));
        parts.join(", ")
    }
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
            OptimizerConfig::Keras(k) => k.name(),
        }
    }

    /// Base learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerConfig::Sgd { lr, .. }
            | OptimizerConfig::Adam { lr, .. }
            | OptimizerConfig::Adamw { lr, .. }
            | OptimizerConfig::Rmsprop { lr, .. }
            | OptimizerConfig::Keras(KerasOptimizer { lr, .. }) => lr,
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
