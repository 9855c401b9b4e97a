//! Keras's optimizers against Keras's own (3.15, its PyTorch backend) on the same gradients.

use std::collections::HashMap;

use tch::{Kind, Tensor};
use trainerd_sdk::{KerasOptimizer, KerasRule, OptimizerConfig};

use super::Optimizer;

/// The variables of the comparison, their shapes: a kernel, its bias, a norm's scale.
const SHAPES: [(&str, &str); 3] = [("dense/kernel", "(6, 4)"), ("dense/bias", "(4,)"), ("norm/gamma", "(4,)")];

/// Runs `optimizer` (a Keras constructor's text) for 20 steps on seeded variables and gradients
/// (the learning rate changed at step 10, as a schedule would), and ours of `config` on the same
/// gradients, comparing every variable after every step.
fn against_keras(optimizer: &str, config: OptimizerConfig) {
    let dir = tempfile::tempdir().unwrap();
    let shapes = SHAPES.iter().map(|(n, s)| format!("{n:?}: {s}")).collect::<Vec<_>>().join(", ");
    let script = format!(
        r#"
import os, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, torch
from safetensors.torch import save_file
torch.manual_seed(0)
shapes = {{{shapes}}}
with keras.device("cpu"):
    variables = {{n: keras.Variable(torch.randn(s), name=n.split("/")[1]) for n, s in shapes.items()}}
    out = {{f"init/{{n}}": v.value.detach().clone() for n, v in variables.items()}}
    opt = keras.optimizers.{optimizer}
    opt.build(list(variables.values()))
    for step in range(20):
        if step == 10:
            opt.learning_rate = opt.learning_rate * 0.5
        grads = [torch.randn(v.shape) * (step + 1) for v in variables.values()]
        for (n, _), g in zip(variables.items(), grads):
            out[f"grad{{step}}/{{n}}"] = g.clone()
        opt.apply(grads, list(variables.values()))
        for n, v in variables.items():
            out[f"after{{step}}/{{n}}"] = v.value.detach().clone()
save_file(out, sys.argv[1])
"#
    );
    let file = dir.path().join("keras.safetensors");
    let run = std::process::Command::new(trainerd_testkit::python()).args(["-c", &script]).arg(&file).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let saved: HashMap<String, Tensor> = Tensor::read_safetensors(&file).unwrap().into_iter().collect();
    let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
    let mut params: Vec<(String, Tensor)> = names
        .iter()
        .map(|n| (format!("model.{n}"), saved[&format!("init/{n}")].copy().set_requires_grad(true)))
        .collect();
    let mut opt = Optimizer::new(config.clone(), &params);
    for step in 0..20 {
        for ((_, p), n) in params.iter_mut().zip(&names) {
            p.zero_grad();
            (&*p * &saved[&format!("grad{step}/{n}")]).sum(Kind::Float).backward();
        }
        let lr = config.lr() as f32 * if step >= 10 { 0.5 } else { 1.0 };
        opt.step(&mut params, lr as f64);
        for ((_, p), n) in params.iter().zip(&names) {
            let theirs = &saved[&format!("after{step}/{n}")];
            let scale = theirs.abs().max().double_value(&[]);
            let d = (p - theirs).abs().max().double_value(&[]) / scale;
            assert!(d <= 2e-7, "{optimizer}: step {step}: {n} differs from Keras's by {d:e} (relative)");
        }
    }
}

fn keras(rule: KerasRule, lr: f64, weight_decay: f64) -> KerasOptimizer {
    KerasOptimizer { rule, weight_decay, ..KerasOptimizer::defaults("sgd", lr).expect("Keras's SGD") }
}

#[test]
fn keras_sgd_matches_keras() {
    let plain = keras(KerasRule::Sgd { momentum: 0.0, nesterov: false }, 0.01, 0.0);
    against_keras("SGD(learning_rate=0.01)", OptimizerConfig::Keras(plain));
    let momentum = keras(KerasRule::Sgd { momentum: 0.9, nesterov: false }, 0.01, 0.0);
    against_keras("SGD(learning_rate=0.01, momentum=0.9)", OptimizerConfig::Keras(momentum));
    let nesterov = keras(KerasRule::Sgd { momentum: 0.8, nesterov: true }, 0.01, 0.05);
    against_keras(
        "SGD(learning_rate=0.01, momentum=0.8, nesterov=True, weight_decay=0.05)",
        OptimizerConfig::Keras(nesterov),
    );
}

#[test]
fn keras_adam_matches_keras_with_epsilon_outside_the_corrected_root() {
    let adam = keras(KerasRule::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-7 }, 0.001, 0.0);
    against_keras("Adam(learning_rate=0.001)", OptimizerConfig::Keras(adam));
    let clipped = KerasOptimizer {
        clipnorm: Some(1.5),
        ..keras(KerasRule::Adam { beta1: 0.8, beta2: 0.99, eps: 1e-3 }, 0.01, 0.0)
    };
    against_keras(
        "Adam(learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-3, clipnorm=1.5)",
        OptimizerConfig::Keras(clipped),
    );
}

#[test]
fn keras_adamw_decays_every_variable_unless_excluded_as_keras_does() {
    let adamw = keras(KerasRule::Adamw { beta1: 0.9, beta2: 0.999, eps: 1e-7 }, 0.01, 0.004);
    against_keras("AdamW(learning_rate=0.01)", OptimizerConfig::Keras(adamw.clone()));
    let excluded = KerasOptimizer { no_decay: vec!["dense/bias".into(), "norm/gamma".into()], ..adamw };
    let text =
        "AdamW(learning_rate=0.01, weight_decay=0.004)\n    opt.exclude_from_weight_decay(var_names=['bias', 'gamma'])";
    against_keras(text, OptimizerConfig::Keras(excluded));
}

#[test]
fn keras_rmsprop_matches_keras_with_epsilon_under_the_root() {
    let plain = keras(KerasRule::Rmsprop { rho: 0.9, momentum: 0.0, eps: 1e-7, centered: false }, 0.001, 0.0);
    against_keras("RMSprop(learning_rate=0.001)", OptimizerConfig::Keras(plain));
    let all = keras(KerasRule::Rmsprop { rho: 0.8, momentum: 0.5, eps: 1e-4, centered: true }, 0.01, 0.01);
    against_keras(
        "RMSprop(learning_rate=0.01, rho=0.8, momentum=0.5, epsilon=1e-4, centered=True, weight_decay=0.01)",
        OptimizerConfig::Keras(all),
    );
}
