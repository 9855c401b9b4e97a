//! The daemon's optimizers: SGD (momentum, Nesterov), Adam and RMSprop with PyTorch's update
//! rules, and every piece of state held as named tensors that can be exported and restored.
//!
//! tch's own optimizers cannot export their state, so a resumed run could not continue exactly;
//! these can. Updates run in place on the model's parameters (shared with the plugin).

use tch::{Device, Kind, Tensor};
use trainerd_sdk::OptimizerConfig;

/// Per-parameter state. `None` where PyTorch creates the buffer lazily.
#[derive(Debug)]
enum Slots {
    Sgd { momentum_buffer: Option<Tensor> },
    Adam { exp_avg: Tensor, exp_avg_sq: Tensor },
    Rmsprop { square_avg: Tensor, momentum_buffer: Option<Tensor>, grad_avg: Option<Tensor> },
}

impl Slots {
    fn named(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = Vec::new();
        match self {
            Slots::Sgd { momentum_buffer } => out.extend(momentum_buffer.iter().map(|t| ("momentum_buffer", t))),
            Slots::Adam { exp_avg, exp_avg_sq } => {
                out.push(("exp_avg", exp_avg));
                out.push(("exp_avg_sq", exp_avg_sq));
            }
            Slots::Rmsprop { square_avg, momentum_buffer, grad_avg } => {
                out.push(("square_avg", square_avg));
                out.extend(momentum_buffer.iter().map(|t| ("momentum_buffer", t)));
                out.extend(grad_avg.iter().map(|t| ("grad_avg", t)));
            }
        }
        out
    }
}

/// Adam over flat buffers: its state, the parameters and their gradients each live in one
/// tensor, and every parameter (and its gradient, once it has one) is a view into it, as
/// PyTorch's `p.data = flat[a:b].view_as(p)` makes it. One update of the whole model is then a
/// dozen kernels rather than a dozen per parameter: on a GPU the launches, not the arithmetic,
/// are what a small model's optimizer costs.
#[derive(Debug)]
struct FlatAdam {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    params: Tensor,
    /// Made at the first step, from the gradients the first backward produced.
    grads: Option<Tensor>,
    /// Each parameter's element count, in order.
    numels: Vec<i64>,
}

impl FlatAdam {
    /// Whether each of `tensors` is the matching view of `flat`.
    fn aliases(&self, flat: &Tensor, tensors: &[Tensor]) -> bool {
        let elt = flat.kind().elt_size_in_bytes();
        let mut at = flat.data_ptr() as usize;
        tensors.iter().zip(&self.numels).all(|(t, &n)| {
            let ok = t.data_ptr() as usize == at;
            at += n as usize * elt;
            ok
        })
    }

    /// Makes each of `tensors` a view of `flat` (one flat tensor with their values when
    /// `flat` is `None`).
    fn alias(&self, flat: Option<Tensor>, tensors: &[Tensor]) -> Tensor {
        let flat = flat.unwrap_or_else(|| Tensor::cat(&tensors.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0));
        let mut at = 0;
        for (t, &n) in tensors.iter().zip(&self.numels) {
            let mut view = flat.narrow(0, at, n).view(t.size().as_slice());
            tch::no_grad(|| view.copy_(t));
            t.shallow_clone().set_data(&view);
            at += n;
        }
        flat
    }
}

/// An optimizer over a fixed, ordered list of parameters.
#[derive(Debug)]
pub(crate) struct Optimizer {
    config: OptimizerConfig,
    names: Vec<String>,
    slots: Vec<Slots>,
    flat: Option<FlatAdam>,
    steps: u64,
}

/// Optimizer state that does not fit the optimizer it is restored into.
#[derive(Debug, thiserror::Error, PartialEq)]
pub(crate) enum RestoreError {
    /// A state tensor the optimizer needs is missing.
    #[error("optimizer state: missing {key}")]
    Missing {
        /// The tensor, as `PARAMETER/SLOT`.
        key: String,
    },
    /// A state tensor of another shape.
    #[error("optimizer state: {key} has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor, as `PARAMETER/SLOT`.
        key: String,
        /// Its shape.
        found: Vec<i64>,
        /// The shape the optimizer needs.
        expected: Vec<i64>,
    },
    /// State tensors the optimizer has no use for (another optimizer's).
    #[error("optimizer state: {given} state tensors given, {used} used")]
    Unused {
        /// Tensors given.
        given: usize,
        /// Tensors used.
        used: usize,
    },
}

impl Optimizer {
    /// A fresh optimizer for `params` (name, tensor), zero state.
    pub(crate) fn new(config: OptimizerConfig, params: &[(String, Tensor)]) -> Optimizer {
        if let (OptimizerConfig::Adam { .. }, Some(numels)) = (&config, flat_layout(params)) {
            let first = &params[0].1;
            let zeros = || Tensor::zeros([numels.iter().sum::<i64>()], (first.kind(), first.device()));
            let (exp_avg, exp_avg_sq) = (zeros(), zeros());
            let mut at = 0;
            let slots = params
                .iter()
                .zip(&numels)
                .map(|((_, p), &n)| {
                    let view = |flat: &Tensor| flat.narrow(0, at, n).view(p.size().as_slice());
                    let slots = Slots::Adam { exp_avg: view(&exp_avg), exp_avg_sq: view(&exp_avg_sq) };
                    at += n;
                    slots
                })
                .collect();
            let names = params.iter().map(|(n, _)| n.clone()).collect();
            let mut flat = FlatAdam { exp_avg, exp_avg_sq, params: Tensor::new(), grads: None, numels };
            flat.params = flat.alias(None, &params.iter().map(|(_, p)| p.shallow_clone()).collect::<Vec<_>>());
            return Optimizer { config, names, slots, flat: Some(flat), steps: 0 };
        }
        let zeros = |t: &Tensor| t.zeros_like();
        let slots = params
            .iter()
            .map(|(_, p)| match &config {
                OptimizerConfig::Sgd { .. } => Slots::Sgd { momentum_buffer: None },
                OptimizerConfig::Adam { .. } => Slots::Adam { exp_avg: zeros(p), exp_avg_sq: zeros(p) },
                OptimizerConfig::Rmsprop { momentum, centered, .. } => Slots::Rmsprop {
                    square_avg: zeros(p),
                    momentum_buffer: (*momentum > 0.0).then(|| zeros(p)),
                    grad_avg: centered.then(|| zeros(p)),
                },
            })
            .collect();
        Optimizer { config, names: params.iter().map(|(n, _)| n.clone()).collect(), slots, flat: None, steps: 0 }
    }

    /// Every state tensor, named `<parameter>/<slot>`, in parameter order.
    pub(crate) fn state(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.slots)
            .flat_map(|(name, slots)| {
                slots.named().into_iter().map(move |(slot, t)| (format!("{name}/{slot}"), t.shallow_clone()))
            })
            .collect()
    }

    /// Restores state exported by [`Optimizer::state`] after `steps` steps.
    pub(crate) fn restore(&mut self, steps: u64, state: &[(String, Tensor)]) -> Result<(), RestoreError> {
        let find = |name: &str| state.iter().find(|(n, _)| n == name).map(|(_, t)| t);
        let mut used = 0;
        for (name, slots) in self.names.iter().zip(self.slots.iter_mut()) {
            let mut take = |slot: &str, dst: &mut Tensor| -> Result<(), RestoreError> {
                let key = format!("{name}/{slot}");
                let Some(src) = find(&key) else { return Err(RestoreError::Missing { key }) };
                if src.size() != dst.size() {
                    return Err(RestoreError::Shape { key, found: src.size(), expected: dst.size() });
                }
                tch::no_grad(|| dst.copy_(src));
                used += 1;
                Ok(())
            };
            match slots {
                Slots::Sgd { momentum_buffer } => {
                    if let Some(src) = find(&format!("{name}/momentum_buffer")) {
                        *momentum_buffer = Some(src.detach().copy());
                        used += 1;
                    }
                }
                Slots::Adam { exp_avg, exp_avg_sq } => {
                    take("exp_avg", exp_avg)?;
                    take("exp_avg_sq", exp_avg_sq)?;
                }
                Slots::Rmsprop { square_avg, momentum_buffer, grad_avg } => {
                    take("square_avg", square_avg)?;
                    if let Some(b) = momentum_buffer {
                        take("momentum_buffer", b)?;
                    }
                    if let Some(g) = grad_avg {
                        take("grad_avg", g)?;
                    }
                }
            }
        }
        if used != state.len() {
            return Err(RestoreError::Unused { given: state.len(), used });
        }
        self.steps = steps;
        Ok(())
    }

    /// One update of every parameter that has a gradient, at learning rate `lr`.
    pub(crate) fn step(&mut self, params: &mut [(String, Tensor)], lr: f64) {
        let _no_grad = tch::no_grad_guard();
        self.steps += 1;
        if !self.step_flat(params, lr) {
            self.step_each(params, lr);
        }
    }

    /// Adam over the whole model at once, on the flat buffers (the parameters are views into
    /// them, so nothing is copied back). The same element-wise arithmetic as
    /// [`Optimizer::step_each`], so the same bits. False (nothing done) unless every parameter
    /// has a gradient of its own kind and device.
    fn step_flat(&mut self, params: &mut [(String, Tensor)], lr: f64) -> bool {
        let (Some(flat), &OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. }) =
            (&mut self.flat, &self.config)
        else {
            return false;
        };
        let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
        let kind = params[0].1.kind();
        if grads.iter().any(|g| !g.defined() || g.kind() != kind || g.device() != flat.exp_avg.device()) {
            return false;
        }
        // Someone replaced a parameter's or a gradient's storage (a gradient set to None and
        // made anew, say): its current values go back into the flat buffer.
        let params: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
        if !flat.aliases(&flat.params, &params) {
            flat.params = flat.alias(None, &params);
        }
        if !flat.grads.as_ref().is_some_and(|g| flat.aliases(g, &grads)) {
            let old = flat.grads.take();
            flat.grads = Some(flat.alias(old, &grads));
        }
        let grad = flat.grads.as_ref().expect("made above").shallow_clone();
        adam_update(
            &mut flat.params,
            grad,
            &mut flat.exp_avg,
            &mut flat.exp_avg_sq,
            (beta1, beta2, eps, weight_decay),
            lr,
            self.steps,
        );
        true
    }

    /// Each parameter on its own.
    fn step_each(&mut self, params: &mut [(String, Tensor)], lr: f64) {
        for ((_, p), slots) in params.iter_mut().zip(self.slots.iter_mut()) {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            match (&self.config, slots) {
                (
                    &OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. },
                    Slots::Sgd { momentum_buffer },
                ) => {
                    let mut d_p = with_decay(grad, p, weight_decay);
                    if momentum != 0.0 {
                        let buf = match momentum_buffer {
                            Some(buf) => {
                                let _ = buf.g_mul_scalar_(momentum).g_add_(&(&d_p * (1.0 - dampening)));
                                buf
                            }
                            None => momentum_buffer.insert(d_p.detach().copy()),
                        };
                        d_p = if nesterov { d_p + &*buf * momentum } else { buf.shallow_clone() };
                    }
                    let _ = p.g_add_(&(d_p * -lr));
                }
                (
                    &OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, .. },
                    Slots::Adam { exp_avg, exp_avg_sq },
                ) => {
                    adam_update(p, grad, exp_avg, exp_avg_sq, (beta1, beta2, eps, weight_decay), lr, self.steps);
                }
                (
                    &OptimizerConfig::Rmsprop { alpha, eps, momentum, weight_decay, .. },
                    Slots::Rmsprop { square_avg, momentum_buffer, grad_avg },
                ) => {
                    let grad = with_decay(grad, p, weight_decay);
                    let _ = square_avg.g_mul_scalar_(alpha).addcmul_(&(&grad * (1.0 - alpha)), &grad);
                    let avg = match grad_avg {
                        Some(g_avg) => {
                            let _ = g_avg.g_mul_scalar_(alpha).g_add_(&(&grad * (1.0 - alpha)));
                            (&*square_avg - &*g_avg * &*g_avg).sqrt() + eps
                        }
                        None => square_avg.sqrt() + eps,
                    };
                    match momentum_buffer {
                        Some(buf) => {
                            let _ = buf.g_mul_scalar_(momentum).addcdiv_(&grad, &avg);
                            let _ = p.g_add_(&(&*buf * -lr));
                        }
                        None => {
                            let _ = p.addcdiv_(&(&grad * -lr), &avg);
                        }
                    }
                }
                _ => unreachable!("slots are built from the same config"),
            }
        }
    }
}

/// Adam's update of `p` (PyTorch's rule) at step `t` (1-based), in place.
fn adam_update(
    p: &mut Tensor,
    grad: Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    (beta1, beta2, eps, weight_decay): (f64, f64, f64, f64),
    lr: f64,
    t: u64,
) {
    let t = t as i32;
    let bias1 = 1.0 - beta1.powi(t);
    let bias2 = 1.0 - beta2.powi(t);
    if adam_fused(p, &grad, exp_avg, exp_avg_sq, (beta1, beta2, eps, weight_decay), (-lr / bias1, bias2.sqrt())) {
        return;
    }
    let grad = with_decay(grad, p, weight_decay);
    let _ = exp_avg.g_mul_scalar_(beta1).g_add_(&(&grad * (1.0 - beta1)));
    let _ = exp_avg_sq.g_mul_scalar_(beta2).addcmul_(&(&grad * (1.0 - beta2)), &grad);
    let denom = exp_avg_sq.sqrt() / bias2.sqrt() + eps;
    let _ = p.addcdiv_(&(&*exp_avg * (-lr / bias1)), &denom);
}

/// A contiguous float32 CPU tensor's elements.
///
/// # Safety
/// `t` must be a contiguous float32 CPU tensor, and no other slice of its storage may be live
/// while this one is.
unsafe fn f32_slice(t: &mut Tensor) -> &mut [f32] {
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, t.numel()) }
}

/// Adam's update of float32 CPU tensors in one pass over memory (libtorch's kernels make about
/// twenty, and on a CPU the update is bound by memory, not arithmetic): the same operations in
/// the same order, each rounded to float32 as the kernels round them, no fused multiply-add.
/// False (nothing done) for other tensors, which take libtorch's kernels.
fn adam_fused(
    p: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    (beta1, beta2, eps, weight_decay): (f64, f64, f64, f64),
    (step_size, bias2_sqrt): (f64, f64),
) -> bool {
    let tensors = [&*p, grad, &*exp_avg, &*exp_avg_sq];
    let n = p.numel();
    if !tensors
        .iter()
        .all(|t| t.kind() == Kind::Float && t.device() == Device::Cpu && t.is_contiguous() && t.numel() == n)
    {
        return false;
    }
    let ptrs: Vec<usize> = tensors.iter().map(|t| t.data_ptr() as usize).collect();
    if (1..4).any(|i| ptrs[..i].contains(&ptrs[i])) {
        return false; // aliased: leave it to the kernels
    }
    // SAFETY: four distinct contiguous float32 CPU tensors of `n` elements, checked above; the
    // slices live only in this function, and nothing else runs on these tensors meanwhile.
    let (p, m, v) = unsafe { (f32_slice(p), f32_slice(exp_avg), f32_slice(exp_avg_sq)) };
    // SAFETY: as above; the gradient is only read.
    let g = unsafe { std::slice::from_raw_parts(grad.data_ptr() as *const f32, n) };
    let (b1, one_b1, b2, one_b2) = (beta1 as f32, (1.0 - beta1) as f32, beta2 as f32, (1.0 - beta2) as f32);
    let (eps, wd, step_size, bias2_sqrt) = (eps as f32, weight_decay as f32, step_size as f32, bias2_sqrt as f32);
    for i in 0..n {
        let grad = if weight_decay == 0.0 { g[i] } else { g[i] + p[i] * wd };
        m[i] = m[i] * b1 + grad * one_b1;
        v[i] = v[i] * b2 + grad * one_b2 * grad;
        let denom = v[i].sqrt() / bias2_sqrt + eps;
        p[i] += m[i] * step_size / denom;
    }
    true
}

/// Each parameter's element count, when they can share flat buffers (one kind, one device,
/// contiguous); `None` otherwise.
fn flat_layout(params: &[(String, Tensor)]) -> Option<Vec<i64>> {
    let (_, first) = params.first()?;
    params
        .iter()
        .map(|(_, p)| {
            (p.kind() == first.kind() && p.device() == first.device() && p.is_contiguous()).then(|| p.numel() as i64)
        })
        .collect()
}

/// `grad + weight_decay * param` (L2 penalty), as PyTorch adds it.
fn with_decay(grad: Tensor, param: &Tensor, weight_decay: f64) -> Tensor {
    if weight_decay == 0.0 {
        grad
    } else {
        grad + param * weight_decay
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, Module};
    use tch::{Device, Kind};

    /// A fixed problem: a two-layer regression on seeded random data.
    fn problem(seed: i64) -> (nn::VarStore, Box<dyn Module>, Tensor, Tensor) {
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let net = nn::seq()
            .add(nn::linear(&root / "a", 5, 8, Default::default()))
            .add_fn(|x| x.tanh())
            .add(nn::linear(&root / "b", 8, 3, Default::default()));
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
    fn rmsprop_matches_libtorch() {
        against_libtorch(OptimizerConfig::rmsprop(1e-2), nn::RmsProp::default());
        let ours = OptimizerConfig::Rmsprop {
            lr: 1e-2,
            alpha: 0.9,
            eps: 1e-7,
            momentum: 0.5,
            weight_decay: 1e-3,
            centered: true,
        };
        against_libtorch(ours, nn::RmsProp { alpha: 0.9, eps: 1e-7, wd: 1e-3, momentum: 0.5, centered: true });
    }

    /// Exported state restored into a fresh optimizer continues bit for bit.
    #[test]
    fn restored_state_continues_bitwise() {
        for config in [
            OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false },
            OptimizerConfig::adam(1e-2),
            OptimizerConfig::Rmsprop {
                lr: 1e-2,
                alpha: 0.9,
                eps: 1e-7,
                momentum: 0.5,
                weight_decay: 0.0,
                centered: true,
            },
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
        assert!(flat.flat.is_some());
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
            let f = flat.flat.as_ref().unwrap();
            assert!(f.aliases(&f.params, &a.iter().map(|(_, p)| p.shallow_clone()).collect::<Vec<_>>()));
            assert!(f.aliases(f.grads.as_ref().unwrap(), &a.iter().map(|(_, p)| p.grad()).collect::<Vec<_>>()));
        }
        let state = |o: &Optimizer| o.state().into_iter().map(|(n, t)| (n, t.copy())).collect::<Vec<_>>();
        assert_eq!(max_diff(&state(&flat), &state(&each)), 0.0);
        // A parameter without a gradient: the per-parameter path, which leaves it alone.
        let unused = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        a.push(("unused".into(), unused.shallow_clone()));
        let mut opt = Optimizer::new(config.clone(), &a);
        assert!(opt.flat.is_some());
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
}
