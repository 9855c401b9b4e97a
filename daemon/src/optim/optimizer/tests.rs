//! The optimizers against libtorch's and `torch.optim`'s, and their state across a restore.

use super::*;
use tch::nn::{self, Module, OptimizerConfig as _};
use tch::{Device, Kind};

/// AdamW of betas (0.9, `beta2`), epsilon 1e-8.
fn adamw(lr: f64, beta2: f64, weight_decay: f64, no_decay: NoDecay) -> OptimizerConfig {
    OptimizerConfig::Adamw { lr, beta1: 0.9, beta2, eps: 1e-8, weight_decay, no_decay }
}

/// A fixed problem: a two-layer regression on seeded random data.
fn problem(seed: i64) -> (nn::VarStore, Box<dyn Module>, Tensor, Tensor) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq().add(nn::linear(&root / "a", 5, 8, Default::default())).add_fn(|x| x.tanh()).add(nn::linear(
        &root / "b",
        8,
        3,
        Default::default(),
    ));
    let x = Tensor::randn([32, 5], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([32, 3], (Kind::Float, Device::Cpu));
    (vs, Box::new(net), x, y)
}

fn sorted_params(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    a.iter().zip(b).map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[])).fold(0.0, f64::max)
}

/// Steps ours and libtorch's optimizer on identical copies, comparing after every step.
fn against_libtorch(ours: OptimizerConfig, theirs: impl nn::OptimizerConfig) {
    let (vs_a, net_a, x, y) = problem(3);
    let (mut vs_b, net_b, _, _) = problem(3);
    // Tests run in parallel and libtorch's generator is global: copy rather than re-seed.
    vs_b.copy(&vs_a).unwrap();
    let mut params_a = sorted_params(&vs_a);
    let mut opt_a = Optimizer::new(ours.clone(), &params_a);
    let mut opt_b = theirs.build(&vs_b, ours.lr()).unwrap();
    assert_eq!(max_diff(&params_a, &sorted_params(&vs_b)), 0.0);
    for step in 0..25 {
        for (_, p) in params_a.iter_mut() {
            p.zero_grad();
        }
        net_a.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        opt_a.step(&mut params_a, ours.lr());
        opt_b.backward_step(&net_b.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        let d = max_diff(&params_a, &sorted_params(&vs_b));
        assert!(d <= 1e-6, "{ours:?}: step {step}: parameters differ by {d}");
    }
}

#[test]
fn sgd_matches_libtorch() {
    against_libtorch(OptimizerConfig::sgd(0.05), nn::Sgd::default());
}

#[test]
fn sgd_momentum_nesterov_weight_decay_match_libtorch() {
    let ours = OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 1e-3, nesterov: true };
    against_libtorch(ours, nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-3, nesterov: true });
    let ours = OptimizerConfig::Sgd { lr: 0.05, momentum: 0.8, dampening: 0.1, weight_decay: 0.0, nesterov: false };
    against_libtorch(ours, nn::Sgd { momentum: 0.8, dampening: 0.1, wd: 0.0, nesterov: false });
}

#[test]
fn adam_matches_libtorch() {
    against_libtorch(OptimizerConfig::adam(1e-2), nn::Adam::default());
    let ours = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 1e-2 };
    against_libtorch(ours, nn::Adam { beta1: 0.8, beta2: 0.99, wd: 1e-2, eps: 1e-6, amsgrad: false });
}

#[test]
fn adamw_matches_libtorch() {
    let ours = adamw(1e-2, 0.999, 0.1, NoDecay::Nothing);
    against_libtorch(ours, nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.1, eps: 1e-8, amsgrad: false });
}

/// AdamW's groups against libtorch's parameter groups: the weights decay, the biases (in
/// libtorch's group 1, of weight decay 0) do not.
#[test]
fn adamw_decay_groups_match_libtorch_groups() {
    let build = |vs: &nn::VarStore| {
        let root = vs.root();
        for (layer, i, o) in [("a", 5, 8), ("b", 8, 3)] {
            let init = nn::Init::Randn { mean: 0.0, stdev: 0.5 };
            let _ = (&root / layer).var("weight", &[o, i], init);
            let _ = (&root / layer).set_group(1).var("bias", &[o], init);
        }
    };
    let forward = |vs: &nn::VarStore, x: &Tensor| {
        let v = vs.variables();
        let h = (x.matmul(&v["a.weight"].tr()) + &v["a.bias"]).tanh();
        h.matmul(&v["b.weight"].tr()) + &v["b.bias"]
    };
    let (vs_a, mut vs_b) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
    build(&vs_a);
    build(&vs_b);
    vs_b.copy(&vs_a).unwrap();
    let x = Tensor::ones([32, 5], (Kind::Float, Device::Cpu)).cumsum(0, Kind::Float).sin();
    let y = Tensor::ones([32, 3], (Kind::Float, Device::Cpu)).cumsum(0, Kind::Float).cos();
    let config = adamw(2e-2, 0.999, 0.3, NoDecay::UnderTwoDims);
    let mut params_a = sorted_params(&vs_a);
    let mut opt_a = Optimizer::new(config.clone(), &params_a);
    assert_eq!(
        Optimizer::describe_groups(opt_a.config(), &params_a).unwrap(),
        "AdamW: weight decay 0.3 on 2 tensor(s), 64 parameter(s); none on 2 tensor(s), 11 parameter(s) (those of \
         fewer than 2 dimensions: biases and norm weights)"
    );
    let mut opt_b =
        nn::AdamW { beta1: 0.9, beta2: 0.999, wd: 0.3, eps: 1e-8, amsgrad: false }.build(&vs_b, 2e-2).unwrap();
    opt_b.set_weight_decay_group(1, 0.0);
    for step in 0..25 {
        params_a.iter_mut().for_each(|(_, p)| p.zero_grad());
        forward(&vs_a, &x).mse_loss(&y, tch::Reduction::Mean).backward();
        opt_a.step(&mut params_a, 2e-2);
        opt_b.backward_step(&forward(&vs_b, &x).mse_loss(&y, tch::Reduction::Mean));
        let d = max_diff(&params_a, &sorted_params(&vs_b));
        assert!(d <= 1e-6, "step {step}: parameters differ by {d}");
    }
}

/// AdamW against `torch.optim.AdamW(foreach=False)` on the same gradients and learning rates,
/// with its groups as a user writes them: by dimensions, and by names.
#[test]
fn adamw_matches_torch_optim_adamw_with_its_groups() {
    for (rule, python_rule) in [
        (NoDecay::UnderTwoDims, "p.dim() < 2"),
        (NoDecay::Names(vec!["bias".into(), "ln".into()]), "any(s in n for s in ('bias', 'ln'))"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            r#"
import sys, torch
from safetensors.torch import save_file
torch.manual_seed(0)
shapes = {{"h.0.attn.weight": (6, 4), "h.0.attn.bias": (6,), "h.0.ln.weight": (4,), "head.weight": (3, 4, 2)}}
params = {{n: torch.randn(s, requires_grad=True) for n, s in shapes.items()}}
out = {{f"init/{{n}}": p.detach().clone() for n, p in params.items()}}
no = [p for n, p in params.items() if {python_rule}]
yes = [p for n, p in params.items() if not ({python_rule})]
opt = torch.optim.AdamW([{{"params": yes, "weight_decay": 0.1}}, {{"params": no, "weight_decay": 0.0}}],
                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
for step in range(20):
    lr = 1e-2 * (step + 1) / 20
    for g in opt.param_groups:
        g["lr"] = lr
    for n, p in params.items():
        p.grad = torch.randn(p.shape) * (step + 1)
        out[f"grad{{step}}/{{n}}"] = p.grad.clone()
    opt.step()
    for n, p in params.items():
        out[f"after{{step}}/{{n}}"] = p.detach().clone()
save_file(out, sys.argv[1])
"#
        );
        let file = dir.path().join("adamw.safetensors");
        let run = std::process::Command::new(trainerd_testkit::python()).args(["-c", &script]).arg(&file).output();
        let run = run.unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        let saved: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(&file).unwrap().into_iter().collect();
        let names = ["h.0.attn.weight", "h.0.attn.bias", "h.0.ln.weight", "head.weight"];
        let mut params: Vec<(String, Tensor)> = names
            .iter()
            .map(|n| (format!("model.{n}"), saved[&format!("init/{n}")].copy().set_requires_grad(true)))
            .collect();
        let config = adamw(1e-2, 0.95, 0.1, rule.clone());
        let mut opt = Optimizer::new(config, &params);
        for step in 0..20 {
            for ((_, p), n) in params.iter_mut().zip(names) {
                p.zero_grad();
                (&*p * &saved[&format!("grad{step}/{n}")]).sum(Kind::Float).backward();
            }
            opt.step(&mut params, 1e-2 * (step + 1) as f64 / 20.0);
            for ((_, p), n) in params.iter().zip(names) {
                let theirs = &saved[&format!("after{step}/{n}")];
                let scale = theirs.abs().max().double_value(&[]);
                let d = (p - theirs).abs().max().double_value(&[]) / scale;
                assert!(d <= 1e-6, "{rule:?}: step {step}: {n} differs from torch.optim.AdamW's by {d:e} (relative)");
            }
        }
    }
}

#[test]
fn rmsprop_matches_libtorch() {
    against_libtorch(OptimizerConfig::rmsprop(1e-2), nn::RmsProp::default());
    let ours =
        OptimizerConfig::Rmsprop { lr: 1e-2, alpha: 0.9, eps: 1e-7, momentum: 0.5, weight_decay: 1e-3, centered: true };
    against_libtorch(ours, nn::RmsProp { alpha: 0.9, eps: 1e-7, wd: 1e-3, momentum: 0.5, centered: true });
}

/// Exported state restored into a fresh optimizer continues bit for bit.
#[test]
fn restored_state_continues_bitwise() {
    for config in [
        OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false },
        OptimizerConfig::adam(1e-2),
        adamw(1e-2, 0.999, 0.1, NoDecay::UnderTwoDims),
        OptimizerConfig::Rmsprop { lr: 1e-2, alpha: 0.9, eps: 1e-7, momentum: 0.5, weight_decay: 0.0, centered: true },
    ] {
        let (vs, net, x, y) = problem(5);
        let mut params = sorted_params(&vs);
        let mut opt = Optimizer::new(config.clone(), &params);
        let step = |opt: &mut Optimizer, params: &mut Vec<(String, Tensor)>| {
            for (_, p) in params.iter_mut() {
                p.zero_grad();
            }
            net.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
            opt.step(params, config.lr());
        };
        for _ in 0..5 {
            step(&mut opt, &mut params);
        }
        let saved_params: Vec<_> = params.iter().map(|(n, p)| (n.clone(), p.detach().copy())).collect();
        let saved_state: Vec<_> = opt.state().into_iter().map(|(n, t)| (n, t.copy())).collect();
        for _ in 0..5 {
            step(&mut opt, &mut params);
        }
        let expected: Vec<_> = params.iter().map(|(n, p)| (n.clone(), p.detach().copy())).collect();

        tch::no_grad(|| {
            for ((_, p), (_, s)) in params.iter_mut().zip(&saved_params) {
                p.copy_(s);
            }
        });
        let mut resumed = Optimizer::new(config.clone(), &params);
        resumed.restore(5, &saved_state).unwrap();
        for _ in 0..5 {
            step(&mut resumed, &mut params);
        }
        assert_eq!(max_diff(&params, &expected), 0.0, "{config:?}");
    }
}

/// Adam's whole-model update gives the bits of the per-parameter one, and falls back to it
/// when a parameter has no gradient.
#[test]
fn flat_adam_is_bitwise_the_per_parameter_update() {
    let config = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 1e-2 };
    let (vs_a, net, x, y) = problem(9);
    let (mut vs_b, net_b, ..) = problem(9);
    vs_b.copy(&vs_a).unwrap();
    let (mut a, mut b) = (sorted_params(&vs_a), sorted_params(&vs_b));
    let mut flat = Optimizer::new(config.clone(), &a);
    let mut each = Optimizer::new(config.clone(), &b);
    assert!(flat.groups[0].flat.is_some());
    for step in 0..10 {
        for params in [&mut a, &mut b] {
            for (_, p) in params.iter_mut() {
                p.zero_grad();
            }
        }
        net.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        net_b.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
        let grads: Vec<_> = a.iter().map(|(_, p)| p.grad().copy()).collect();
        tch::no_grad(|| b.iter().zip(&grads).for_each(|((_, p), g)| p.grad().copy_(g)));
        flat.step(&mut a, config.lr());
        each.steps += 1;
        tch::no_grad(|| each.step_each(&mut b, config.lr()));
        assert_eq!(max_diff(&a, &b), 0.0, "step {step}");
        // The parameters and their gradients stay views of the flat buffers: backward
        // accumulates in place, nothing is gathered or copied back.
        let f = flat.groups[0].flat.as_ref().unwrap();
        assert!(f.aliases(&f.params, &a.iter().map(|(_, p)| p.shallow_clone()).collect::<Vec<_>>()));
        assert!(f.aliases(f.grads.as_ref().unwrap(), &a.iter().map(|(_, p)| p.grad()).collect::<Vec<_>>()));
    }
    let state = |o: &Optimizer| o.state().into_iter().map(|(n, t)| (n, t.copy())).collect::<Vec<_>>();
    assert_eq!(max_diff(&state(&flat), &state(&each)), 0.0);
    // A parameter without a gradient: the per-parameter path, which leaves it alone.
    let unused = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    a.push(("unused".into(), unused.shallow_clone()));
    let mut opt = Optimizer::new(config.clone(), &a);
    assert!(opt.groups[0].flat.is_some());
    net.forward(&x).mse_loss(&y, tch::Reduction::Mean).backward();
    let before = a[0].1.detach().copy();
    assert!(!opt.step_flat(&mut a, config.lr()));
    opt.step(&mut a, config.lr());
    assert!(max_diff(&a[..1], &[("".into(), before)]) > 0.0);
    assert_eq!(unused.abs().sum(Kind::Float).double_value(&[]), 0.0);
}

#[test]
fn restore_refuses_a_wrong_shape() {
    let (vs, ..) = problem(1);
    let params = sorted_params(&vs);
    let mut opt = Optimizer::new(OptimizerConfig::adam(1e-3), &params);
    let mut state = opt.state();
    state[0].1 = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    let err = opt.restore(1, &state).unwrap_err().to_string();
    assert_eq!(err, "optimizer state: a.bias/exp_avg has shape [2], expected [8]");
}

/// Every optimizer's one-pass float32 loop (`elementwise`) against its libtorch kernels: a twin
/// whose parameters are transposed views (not contiguous, so the kernels' path) steps on the
/// same gradients. SGD's kernels are one operation each, and the loop gives their bits. Adam's
/// and RMSprop's use `addcmul` and `addcdiv`, which a kernel set may compile into fused
/// multiply-adds, so the loop (which every float32 CPU update runs, in both modes) stays within
/// an ulp or two of them. Lengths are odd, so the kernels' scalar tails are covered as well as
/// their vector bodies.
#[test]
fn the_one_pass_loops_against_libtorchs_kernels() {
    let bound = |config: &OptimizerConfig| if matches!(config, OptimizerConfig::Sgd { .. }) { 0.0 } else { 2e-6 };
    for config in [
        OptimizerConfig::sgd(0.05),
        OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 1e-3, nesterov: true },
        OptimizerConfig::Sgd { lr: 0.05, momentum: 0.8, dampening: 0.1, weight_decay: 0.0, nesterov: false },
        OptimizerConfig::Adam { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 1e-2 },
        adamw(1e-2, 0.95, 0.1, NoDecay::Nothing),
        OptimizerConfig::rmsprop(1e-2),
        OptimizerConfig::Rmsprop { lr: 1e-2, alpha: 0.9, eps: 1e-7, momentum: 0.5, weight_decay: 1e-3, centered: true },
        OptimizerConfig::Rmsprop { lr: 1e-2, alpha: 0.9, eps: 1e-7, momentum: 0.0, weight_decay: 0.0, centered: true },
    ] {
        let shapes = [[37i64, 19], [3, 1], [11, 23]];
        let opts = (Kind::Float, Device::Cpu);
        let values: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
        let straight: Vec<(String, Tensor)> =
            values.iter().enumerate().map(|(i, v)| (format!("m.p{i}"), v.copy().set_requires_grad(true))).collect();
        let transposed: Vec<(String, Tensor)> = values
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("m.p{i}"), v.transpose(0, 1).contiguous().transpose(0, 1).set_requires_grad(true)))
            .collect();
        assert!(!transposed[0].1.is_contiguous(), "the twin takes libtorch's kernels");
        let (mut a, mut b) = (straight, transposed);
        let (mut fused, mut kernels) = (Optimizer::new(config.clone(), &a), Optimizer::new(config.clone(), &b));
        for step in 0..6 {
            let weights: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, opts)).collect();
            for params in [&mut a, &mut b] {
                for ((_, p), w) in params.iter_mut().zip(&weights) {
                    p.zero_grad();
                    (&*p * w).sum(Kind::Float).backward();
                }
            }
            assert!(!b[0].1.grad().is_contiguous());
            fused.step(&mut a, config.lr());
            kernels.step(&mut b, config.lr());
            let d = max_diff(&a, &b);
            assert!(d <= bound(&config), "{config:?}: step {step}: the parameters differ by {d}");
        }
        let state = |o: &Optimizer| o.state().into_iter().map(|(n, t)| (n, t.contiguous())).collect::<Vec<_>>();
        let d = max_diff(&state(&fused), &state(&kernels));
        assert!(d <= bound(&config), "{config:?}: the state differs by {d}");
    }
}
