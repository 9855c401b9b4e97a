//! The optimizer's settings: the plugin's default optimizer with the operator's flags applied.
//! A flag wins over the plugin's default; a flag that does not apply to the chosen optimizer is
//! an error rather than silently ignored.

use trainerd_sdk::{KerasOptimizer, KerasRule, NoDecay, OptimizerConfig};

use super::FlagError;

/// Optimizer overrides from the command line.
#[derive(Clone, Debug, Default)]
pub(crate) struct OptimizerFlags {
    /// `--optimizer`: `sgd`, `adam`, `adamw` or `rmsprop`.
    pub(crate) name: Option<String>,
    /// `--lr`.
    pub(crate) lr: Option<f64>,
    /// `--momentum` (sgd, rmsprop).
    pub(crate) momentum: Option<f64>,
    /// `--weight-decay`.
    pub(crate) weight_decay: Option<f64>,
    /// `--nesterov` (sgd).
    pub(crate) nesterov: bool,
    /// `--adam-beta1`, `--adam-beta2`, `--adam-epsilon` (adam, adamw).
    pub(crate) adam: [Option<f64>; 3],
    /// `--decay-all-parameters` (adamw).
    pub(crate) decay_all: bool,
}

/// The plugin's default optimizer with the operator's overrides applied. Choosing another
/// optimizer starts from PyTorch's defaults for it (and the plugin's learning rate, unless
/// `--lr` is given). AdamW leaves undecayed the parameters the model names (`no_decay`), or, when
/// it names none, those of fewer than 2 dimensions.
pub(crate) fn optimizer(
    default: &OptimizerConfig,
    flags: &OptimizerFlags,
    no_decay: &[String],
) -> Result<OptimizerConfig, FlagError> {
    let mut config = chosen(default, flags.name.as_deref())?;
    if let OptimizerConfig::Keras(k) = &mut config {
        keras(k, flags)?;
        return checked(config);
    }
    applicable(&config, flags)?;
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
        OptimizerConfig::Adam { lr, weight_decay, beta1, beta2, eps }
        | OptimizerConfig::Adamw { lr, weight_decay, beta1, beta2, eps, .. } => {
            set(lr, flags.lr);
            set(weight_decay, flags.weight_decay);
            for (field, flag) in [beta1, beta2, eps].into_iter().zip(flags.adam) {
                set(field, flag);
            }
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
        OptimizerConfig::Keras(_) => unreachable!("handled above"),
    }
    if let OptimizerConfig::Adamw { no_decay: rule, .. } = &mut config {
        if flags.decay_all {
            *rule = NoDecay::Nothing;
        } else if !no_decay.is_empty() && *rule == NoDecay::UnderTwoDims {
            *rule = NoDecay::Names(no_decay.to_vec());
        }
    }
    checked(config)
}

/// Refuses the Adam flags and `--decay-all-parameters` where `config` (PyTorch's rules) has no use
/// for them.
fn applicable(config: &OptimizerConfig, flags: &OptimizerFlags) -> Result<(), FlagError> {
    let inapplicable = |flag: &'static str| FlagError::Inapplicable { flag, optimizer: config.name() };
    if let Some(flag) = adam_flag(flags) {
        if !matches!(config, OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. }) {
            return Err(inapplicable(flag));
        }
    }
    if flags.decay_all && !matches!(config, OptimizerConfig::Adamw { .. }) {
        return Err(inapplicable("--decay-all-parameters"));
    }
    Ok(())
}

/// The first Adam flag given (`--adam-beta1`, `--adam-beta2`, `--adam-epsilon`), if any.
fn adam_flag(flags: &OptimizerFlags) -> Option<&'static str> {
    let adams = ["--adam-beta1", "--adam-beta2", "--adam-epsilon"];
    flags.adam.iter().position(Option::is_some).map(|i| adams[i])
}

/// The flags over a Keras model's optimizer (Keras's rules): each hyper-parameter of Keras's that
/// a flag names; `--decay-all-parameters` undoes `exclude_from_weight_decay`.
fn keras(k: &mut KerasOptimizer, flags: &OptimizerFlags) -> Result<(), FlagError> {
    let name = k.name();
    let inapplicable = |flag: &'static str| FlagError::Inapplicable { flag, optimizer: name };
    set(&mut k.lr, flags.lr);
    set(&mut k.weight_decay, flags.weight_decay);
    if flags.decay_all {
        k.no_decay.clear();
    }
    match &mut k.rule {
        KerasRule::Sgd { momentum, nesterov } => {
            set(momentum, flags.momentum);
            *nesterov |= flags.nesterov;
            if *nesterov && *momentum <= 0.0 {
                return Err(FlagError::NesterovWithoutMomentum);
            }
        }
        KerasRule::Adam { beta1, beta2, eps } | KerasRule::Adamw { beta1, beta2, eps } => {
            for (field, flag) in [beta1, beta2, eps].into_iter().zip(flags.adam) {
                set(field, flag);
            }
            if flags.momentum.is_some() {
                return Err(inapplicable("--momentum"));
            }
        }
        KerasRule::Rmsprop { momentum, .. } => set(momentum, flags.momentum),
    }
    if flags.nesterov && !matches!(k.rule, KerasRule::Sgd { .. }) {
        return Err(inapplicable("--nesterov"));
    }
    if let Some(flag) = adam_flag(flags) {
        if !matches!(k.rule, KerasRule::Adam { .. } | KerasRule::Adamw { .. }) {
            return Err(inapplicable(flag));
        }
    }
    Ok(())
}

/// Which of a Keras model's hyper-parameters the flags set, as the start-up line says it:
/// `--lr` and `--momentum` over compile()'s, or `None` when the flags set none.
pub(crate) fn keras_overrides(flags: &OptimizerFlags) -> Option<String> {
    let given: Vec<&str> = [
        (flags.name.is_some(), "--optimizer"),
        (flags.lr.is_some(), "--lr"),
        (flags.momentum.is_some(), "--momentum"),
        (flags.weight_decay.is_some(), "--weight-decay"),
        (flags.nesterov, "--nesterov"),
        (flags.adam[0].is_some(), "--adam-beta1"),
        (flags.adam[1].is_some(), "--adam-beta2"),
        (flags.adam[2].is_some(), "--adam-epsilon"),
        (flags.decay_all, "--decay-all-parameters"),
    ]
    .into_iter()
    .filter_map(|(set, flag)| set.then_some(flag))
    .collect();
    (!given.is_empty()).then(|| given.join(", "))
}

/// The optimizer `--optimizer` names (the plugin's default when it names none, or the default's
/// own), with PyTorch's defaults and the default's learning rate; Keras's defaults when the
/// default is a Keras model's.
fn chosen(default: &OptimizerConfig, name: Option<&str>) -> Result<OptimizerConfig, FlagError> {
    Ok(match name {
        None => default.clone(),
        Some(name) if name == default.name() => default.clone(),
        Some(name) if matches!(default, OptimizerConfig::Keras(_)) => {
            match KerasOptimizer::defaults(name, default.lr()) {
                Some(k) => OptimizerConfig::Keras(k),
                None => {
                    return Err(FlagError::Form {
                        flag: "--optimizer",
                        text: name.into(),
                        expected: "sgd, adam, adamw or rmsprop",
                    })
                }
            }
        }
        Some("sgd") => OptimizerConfig::sgd(default.lr()),
        Some("adam") => OptimizerConfig::adam(default.lr()),
        Some("adamw") => OptimizerConfig::adamw(default.lr()),
        Some("rmsprop") => OptimizerConfig::rmsprop(default.lr()),
        Some(other) => {
            return Err(FlagError::Form {
                flag: "--optimizer",
                text: other.into(),
                expected: "sgd, adam, adamw or rmsprop",
            })
        }
    })
}

/// `config`, when its learning rate and betas are in range.
fn checked(config: OptimizerConfig) -> Result<OptimizerConfig, FlagError> {
    if !(config.lr() > 0.0 && config.lr().is_finite()) {
        return Err(FlagError::Form { flag: "--lr", text: config.lr().to_string(), expected: "a positive number" });
    }
    let betas = match config {
        OptimizerConfig::Adam { beta1, beta2, .. } | OptimizerConfig::Adamw { beta1, beta2, .. } => {
            Some((beta1, beta2))
        }
        OptimizerConfig::Keras(KerasOptimizer {
            rule: KerasRule::Adam { beta1, beta2, .. } | KerasRule::Adamw { beta1, beta2, .. },
            ..
        }) => Some((beta1, beta2)),
        _ => None,
    };
    if let Some((beta1, beta2)) = betas {
        for (flag, beta) in [("--adam-beta1", beta1), ("--adam-beta2", beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(FlagError::Form { flag, text: beta.to_string(), expected: "a number from 0 to below 1" });
            }
        }
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
        assert_eq!(optimizer(&default, &OptimizerFlags::default(), &[]), Ok(default.clone()));
        let flags = OptimizerFlags { lr: Some(0.01), ..Default::default() };
        assert_eq!(optimizer(&default, &flags, &[]), Ok(OptimizerConfig::adam(0.01)));
        let flags =
            OptimizerFlags { name: Some("sgd".into()), momentum: Some(0.9), nesterov: true, ..Default::default() };
        assert_eq!(
            optimizer(&default, &flags, &[]),
            Ok(OptimizerConfig::Sgd { lr: 1e-3, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: true })
        );
    }

    #[test]
    fn inapplicable_flags_are_refused() {
        let default = OptimizerConfig::adam(1e-3);
        let flags = OptimizerFlags { momentum: Some(0.9), ..Default::default() };
        assert_eq!(
            optimizer(&default, &flags, &[]).unwrap_err().to_string(),
            "--momentum does not apply to optimizer adam"
        );
        let flags = OptimizerFlags { name: Some("lamb".into()), ..Default::default() };
        assert_eq!(
            optimizer(&default, &flags, &[]).unwrap_err().to_string(),
            "--optimizer lamb: expected sgd, adam, adamw or rmsprop"
        );
        let flags = OptimizerFlags { lr: Some(-1.0), ..Default::default() };
        assert_eq!(optimizer(&default, &flags, &[]).unwrap_err().to_string(), "--lr -1: expected a positive number");
    }

    #[test]
    fn adamw_takes_its_groups_from_the_model_or_the_flag() {
        let default = OptimizerConfig::adam(1e-3);
        let adamw = OptimizerFlags { name: Some("adamw".into()), ..Default::default() };
        assert_eq!(optimizer(&default, &adamw, &[]), Ok(OptimizerConfig::adamw(1e-3)));
        let named = ["bias".to_string(), "norm".to_string()];
        let Ok(OptimizerConfig::Adamw { no_decay, weight_decay, .. }) = optimizer(&default, &adamw, &named) else {
            panic!("adamw")
        };
        assert_eq!((no_decay, weight_decay), (NoDecay::Names(named.to_vec()), 0.01));
        let all = OptimizerFlags { decay_all: true, adam: [None, Some(0.95), None], ..adamw.clone() };
        let Ok(OptimizerConfig::Adamw { no_decay, beta2, .. }) = optimizer(&default, &all, &named) else {
            panic!("adamw")
        };
        assert_eq!((no_decay, beta2), (NoDecay::Nothing, 0.95));
        let adam = OptimizerFlags { decay_all: true, ..Default::default() };
        assert_eq!(
            optimizer(&default, &adam, &[]).unwrap_err().to_string(),
            "--decay-all-parameters does not apply to optimizer adam"
        );
        let sgd = OptimizerFlags { name: Some("sgd".into()), adam: [None, Some(0.95), None], ..Default::default() };
        assert_eq!(
            optimizer(&default, &sgd, &[]).unwrap_err().to_string(),
            "--adam-beta2 does not apply to optimizer sgd"
        );
        let beta = OptimizerFlags { adam: [Some(1.0), None, None], ..adamw };
        assert_eq!(
            optimizer(&default, &beta, &[]).unwrap_err().to_string(),
            "--adam-beta1 1: expected a number from 0 to below 1"
        );
    }
}
