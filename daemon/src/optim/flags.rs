//! The optimizer's settings: the plugin's default optimizer with the operator's flags applied.
//! A flag wins over the plugin's default; a flag that does not apply to the chosen optimizer is
//! an error rather than silently ignored.

use trainerd_sdk::OptimizerConfig;

use super::FlagError;

/// Optimizer overrides from the command line.
#[derive(Clone, Debug, Default)]
pub(crate) struct OptimizerFlags {
    /// `--optimizer`: `sgd`, `adam` or `rmsprop`.
    pub(crate) name: Option<String>,
    /// `--lr`.
    pub(crate) lr: Option<f64>,
    /// `--momentum` (sgd, rmsprop).
    pub(crate) momentum: Option<f64>,
    /// `--weight-decay`.
    pub(crate) weight_decay: Option<f64>,
    /// `--nesterov` (sgd).
    pub(crate) nesterov: bool,
}

/// The plugin's default optimizer with the operator's overrides applied. Choosing another
/// optimizer starts from PyTorch's defaults for it (and the plugin's learning rate, unless
/// `--lr` is given).
pub(crate) fn optimizer(default: &OptimizerConfig, flags: &OptimizerFlags) -> Result<OptimizerConfig, FlagError> {
    let mut config = match flags.name.as_deref() {
        None => default.clone(),
        Some(name) if name == default.name() => default.clone(),
        Some("sgd") => OptimizerConfig::sgd(default.lr()),
        Some("adam") => OptimizerConfig::adam(default.lr()),
        Some("rmsprop") => OptimizerConfig::rmsprop(default.lr()),
        Some(other) => {
            return Err(FlagError::Form { flag: "--optimizer", text: other.into(), expected: "sgd, adam or rmsprop" })
        }
    };
    let name = config.name();
    let inapplicable = |flag: &'static str| FlagError::Inapplicable { flag, optimizer: name };
    match &mut config {
        OptimizerConfig::Sgd { lr, momentum, weight_decay, nesterov, .. } => {
            set(lr, flags.lr);
            set(momentum, flags.momentum);
            set(weight_decay, flags.weight_decay);
            *nesterov |= flags.nesterov;
            if *nesterov && *momentum <= 0.0 {
                return Err(FlagError::NesterovWithoutMomentum);
            }
        }
        OptimizerConfig::Adam { lr, weight_decay, .. } => {
            set(lr, flags.lr);
            set(weight_decay, flags.weight_decay);
            if flags.momentum.is_some() {
                return Err(inapplicable("--momentum"));
            }
            if flags.nesterov {
                return Err(inapplicable("--nesterov"));
            }
        }
        OptimizerConfig::Rmsprop { lr, momentum, weight_decay, .. } => {
            set(lr, flags.lr);
            set(momentum, flags.momentum);
            set(weight_decay, flags.weight_decay);
            if flags.nesterov {
                return Err(inapplicable("--nesterov"));
            }
        }
    }
    if !(config.lr() > 0.0 && config.lr().is_finite()) {
        return Err(FlagError::Form { flag: "--lr", text: config.lr().to_string(), expected: "a positive number" });
    }
    Ok(config)
}

fn set(field: &mut f64, flag: Option<f64>) {
    if let Some(v) = flag {
        *field = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_defaults() {
        let default = OptimizerConfig::adam(1e-3);
        assert_eq!(optimizer(&default, &OptimizerFlags::default()), Ok(default.clone()));
        let flags = OptimizerFlags { lr: Some(0.01), ..Default::default() };
        assert_eq!(optimizer(&default, &flags), Ok(OptimizerConfig::adam(0.01)));
        let flags =
            OptimizerFlags { name: Some("sgd".into()), momentum: Some(0.9), nesterov: true, ..Default::default() };
        assert_eq!(
            optimizer(&default, &flags),
            Ok(OptimizerConfig::Sgd { lr: 1e-3, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: true })
        );
    }

    #[test]
    fn inapplicable_flags_are_refused() {
        let default = OptimizerConfig::adam(1e-3);
        let flags = OptimizerFlags { momentum: Some(0.9), ..Default::default() };
        assert_eq!(optimizer(&default, &flags).unwrap_err().to_string(), "--momentum does not apply to optimizer adam");
        let flags = OptimizerFlags { name: Some("lamb".into()), ..Default::default() };
        assert_eq!(
            optimizer(&default, &flags).unwrap_err().to_string(),
            "--optimizer lamb: expected sgd, adam or rmsprop"
        );
        let flags = OptimizerFlags { lr: Some(-1.0), ..Default::default() };
        assert_eq!(optimizer(&default, &flags).unwrap_err().to_string(), "--lr -1: expected a positive number");
    }
}
