//! The flags of the optimizer and the learning rate's schedule, over the plugin's defaults.

use trainerd_sdk::LrSchedule;

use crate::optim::schedule::Warmup;

/// The optimizer's and the schedule's flags (`trainerd run`).
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct OptimArgs {
    /// Optimizer: sgd, adam, adamw or rmsprop (default: the plugin's).
    #[arg(long)]
    pub(crate) optimizer: Option<String>,
    /// Learning rate.
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    /// Momentum (sgd, rmsprop).
    #[arg(long)]
    pub(crate) momentum: Option<f64>,
    /// Weight decay: an L2 penalty on the gradient (sgd, adam, rmsprop), or AdamW's decoupled
    /// decay (adamw, default 0.01 as PyTorch's; Hugging Face's Trainer uses 0).
    #[arg(long)]
    pub(crate) weight_decay: Option<f64>,
    /// Nesterov momentum (sgd).
    #[arg(long)]
    pub(crate) nesterov: bool,
    /// Adam's and AdamW's beta1, the first moment's decay (default 0.9).
    #[arg(long)]
    pub(crate) adam_beta1: Option<f64>,
    /// Adam's and AdamW's beta2, the second moment's decay (default 0.999; language models
    /// often take 0.95).
    #[arg(long)]
    pub(crate) adam_beta2: Option<f64>,
    /// Adam's and AdamW's epsilon (default 1e-8).
    #[arg(long)]
    pub(crate) adam_epsilon: Option<f64>,
    /// AdamW decays every parameter. Default: none of fewer than 2 dimensions (biases and norm
    /// weights), or none of those the model names (a Python model's `no_decay`).
    #[arg(long)]
    pub(crate) decay_all_parameters: bool,
    /// Learning-rate schedule: constant, linear, cosine[:MIN_LR],
    /// wsd:DECAY[:MIN_LR_RATIO[:cosine|linear|1-sqrt]], step:EVERY:GAMMA or exp:GAMMA. Hugging
    /// Face's formulas (see the README).
    #[arg(long, value_parser = crate::optim::schedule::parse)]
    pub(crate) lr_schedule: Option<LrSchedule>,
    /// A linear warmup of the learning rate from 0 before the schedule: N steps, or a fraction of
    /// the run's steps (0.05), as Hugging Face's warmup_steps.
    #[arg(long, value_parser = Warmup::parse)]
    pub(crate) warmup_steps: Option<Warmup>,
}
