//! The daemon's optimizers: SGD (momentum, Nesterov), Adam, AdamW (with its decay groups) and
//! RMSprop with PyTorch's update rules, the same four with Keras's (a Keras model's `compile`),
//! and every piece of state held as named tensors that can be exported and restored.
//!
//! tch's own optimizers cannot export their state, so a resumed run could not continue exactly;
//! these can. Updates run in place on the model's parameters (shared with the plugin).

use tch::Tensor;
use trainerd_sdk::{KerasOptimizer, KerasRule, NoDecay, OptimizerConfig};

use super::adam::{self, FlatAdam, Hyper};
use super::elementwise::{self, KerasClip, Rule};

/// Per-parameter state. `None` where PyTorch creates the buffer lazily.
#[derive(Debug)]
enum Slots {
    Sgd { momentum_buffer: Option<Tensor> },
    Adam { exp_avg: Tensor, exp_avg_sq: Tensor },
    Rmsprop { square_avg: Tensor, momentum_buffer: Option<Tensor>, grad_avg: Option<Tensor> },
}

impl Slots {
    /// RMSprop's state for `p`, zeros (PyTorch's rule or Keras's).
    fn rmsprop(p: &Tensor, momentum: f64, centered: bool) -> Slots {
        Slots::Rmsprop {
            square_avg: p.zeros_like(),
            momentum_buffer: (momentum > 0.0).then(|| p.zeros_like()),
            grad_avg: centered.then(|| p.zeros_like()),
        }
    }

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

/// A group of parameters that share a weight decay, as PyTorch's `param_groups` hold them:
/// Adam's and AdamW's each with flat buffers of its own when its parameters can share them.
#[derive(Debug)]
struct Group {
    /// Its parameters' places in the optimizer's list, in order.
    members: Vec<usize>,
    weight_decay: f64,
    /// False for AdamW's group of parameters it does not decay.
    decays: bool,
    flat: Option<FlatAdam>,
}

/// An optimizer over a fixed, ordered list of parameters.
#[derive(Debug)]
pub(crate) struct Optimizer {
    config: OptimizerConfig,
    names: Vec<String>,
    slots: Vec<Slots>,
    groups: Vec<Group>,
    steps: u64,
}

/// Per parameter with a gradient in a step, its rule and whether this is its first gradient
/// (SGD's momentum buffer is made from it): [`Optimizer::ranged`].
pub(crate) type RangedRules = Vec<Option<(Rule, bool)>>;

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

/// A parameter's name under the model (as the plugin names it: `named_parameters()` for a
/// Python model), what AdamW's name rule matches: its variable's name without its first part,
/// the path every model is built under (`model.blocks.0.ln1.weight`).
fn short_name(name: &str) -> &str {
    name.split_once('.').map_or(name, |(_, rest)| rest)
}

/// The groups of `config` over `params`: AdamW's decayed parameters, then its undecayed ones
/// (each only when it has a parameter); every other optimizer's one group.
fn groups(config: &OptimizerConfig, params: &[(String, Tensor)]) -> Vec<Group> {
    let all = (0..params.len()).collect::<Vec<_>>();
    let one = |weight_decay| vec![Group { members: all.clone(), weight_decay, decays: true, flat: None }];
    match config {
        OptimizerConfig::Sgd { weight_decay, .. }
        | OptimizerConfig::Adam { weight_decay, .. }
        | OptimizerConfig::Rmsprop { weight_decay, .. } => one(*weight_decay),
        OptimizerConfig::Adamw { weight_decay, no_decay, .. } => {
            decay_groups(&all, *weight_decay, |i| no_decay.exempts(short_name(&params[i].0), params[i].1.dim()))
        }
        OptimizerConfig::Keras(k) => decay_groups(&all, k.weight_decay, |i| keras_exempts(k, &params[i].0)),
    }
}

/// The parameters `all` in two groups: those decayed by `weight_decay`, then those `exempt` leaves
/// undecayed (each only when it has a parameter).
fn decay_groups(all: &[usize], weight_decay: f64, exempt: impl Fn(usize) -> bool) -> Vec<Group> {
    let (undecayed, decayed): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&i| exempt(i));
    [(decayed, weight_decay, true), (undecayed, 0.0, false)]
        .into_iter()
        .filter(|(members, ..)| !members.is_empty())
        .map(|(members, weight_decay, decays)| Group { members, weight_decay, decays, flat: None })
        .collect()
}

/// Whether Keras's `exclude_from_weight_decay` exempts the parameter `name` (the variable's path,
/// under the model's).
fn keras_exempts(k: &KerasOptimizer, name: &str) -> bool {
    k.no_decay.iter().any(|n| n == name || n == short_name(name))
}

impl Optimizer {
    /// A fresh optimizer for `params` (name, tensor), zero state.
    pub(crate) fn new(config: OptimizerConfig, params: &[(String, Tensor)]) -> Optimizer {
        let names = params.iter().map(|(n, _)| n.clone()).collect();
        let mut groups = groups(&config, params);
        let mut slots: Vec<Option<Slots>> = params.iter().map(|_| None).collect();
        if matches!(config, OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. }) {
            for group in &mut groups {
                let tensors: Vec<Tensor> = group.members.iter().map(|&i| params[i].1.shallow_clone()).collect();
                let Some(flat) = FlatAdam::new(&tensors) else { continue };
                let views = flat.views(&flat.exp_avg, &tensors).into_iter().zip(flat.views(&flat.exp_avg_sq, &tensors));
                for (&i, (exp_avg, exp_avg_sq)) in group.members.iter().zip(views) {
                    slots[i] = Some(Slots::Adam { exp_avg, exp_avg_sq });
                }
                group.flat = Some(flat);
            }
        }
        let zeros = |t: &Tensor| t.zeros_like();
        let slots = params
            .iter()
            .zip(slots)
            .map(|((_, p), made)| match (&config, made) {
                (_, Some(slots)) => slots,
                (OptimizerConfig::Sgd { .. }, None) => Slots::Sgd { momentum_buffer: None },
                (OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. }, None) => {
                    Slots::Adam { exp_avg: zeros(p), exp_avg_sq: zeros(p) }
                }
                (&OptimizerConfig::Rmsprop { momentum, centered, .. }, None) => Slots::rmsprop(p, momentum, centered),
                // Keras makes every slot at the start, zeros.
                (OptimizerConfig::Keras(k), None) => match k.rule {
                    KerasRule::Sgd { momentum, .. } => {
                        Slots::Sgd { momentum_buffer: (momentum != 0.0).then(|| zeros(p)) }
                    }
                    KerasRule::Adam { .. } | KerasRule::Adamw { .. } => {
                        Slots::Adam { exp_avg: zeros(p), exp_avg_sq: zeros(p) }
                    }
                    KerasRule::Rmsprop { momentum, centered, .. } => Slots::rmsprop(p, momentum, centered),
                },
            })
            .collect();
        Optimizer { config, names, slots, groups, steps: 0 }
    }

    /// AdamW's groups as the start-up line says them: how many tensors and parameters each
    /// holds, and by which rule. `None` for the other optimizers.
    pub(crate) fn describe_groups(config: &OptimizerConfig, params: &[(String, Tensor)]) -> Option<String> {
        let OptimizerConfig::Adamw { weight_decay, no_decay, .. } = config else { return None };
        let groups = groups(config, params);
        let held = |decays: bool| {
            let members = groups.iter().filter(|g| g.decays == decays).flat_map(|g| &g.members);
            let (tensors, elements) = members.fold((0, 0), |(t, e), &i| (t + 1, e + params[i].1.numel()));
            format!("{tensors} tensor(s), {elements} parameter(s)")
        };
        let rule = match no_decay {
            NoDecay::Nothing => {
                return Some(format!(
                    "AdamW: weight decay {weight_decay} on every parameter ({}; --decay-all-parameters)",
                    held(true)
                ))
            }
            NoDecay::UnderTwoDims => "those of fewer than 2 dimensions: biases and norm weights".to_string(),
            NoDecay::Names(parts) => format!(
                "those whose names contain {}",
                parts.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(" or ")
            ),
        };
        Some(format!("AdamW: weight decay {weight_decay} on {}; none on {} ({rule})", held(true), held(false)))
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

    /// The gradients are views of the buckets' buffers (their in-place staging, on the CPU): the
    /// flat update leaves them there rather than making them views of its own buffer, which the
    /// next step's staging would undo (two copies of every gradient a step, and two of each held).
    pub(crate) fn leave_grads(&mut self) {
        self.groups.iter_mut().filter_map(|g| g.flat.as_mut()).for_each(FlatAdam::leave_grads);
    }

    /// One update of every parameter that has a gradient, at learning rate `lr`.
    pub(crate) fn step(&mut self, params: &mut [(String, Tensor)], lr: f64) {
        let _no_grad = tch::no_grad_guard();
        self.steps += 1;
        if !self.step_flat(params, lr) {
            self.step_each(params, lr);
        }
    }

    /// Adam's hyper-parameters for a group of weight decay `weight_decay`; `None` for the other
    /// optimizers.
    fn hyper(&self, weight_decay: f64) -> Option<Hyper> {
        hyper(&self.config, weight_decay)
    }

    /// Adam over each group at once, on its flat buffers (the parameters are views into them,
    /// so nothing is copied back). The same element-wise arithmetic as
    /// [`Optimizer::step_each`], so the same bits. False (nothing done) unless every group has
    /// flat buffers and every parameter a gradient of its own kind and device.
    fn step_flat(&mut self, params: &mut [(String, Tensor)], lr: f64) -> bool {
        let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
        let ready = |g: &Group| {
            g.flat.as_ref().is_some_and(|flat| {
                let (kind, device) = (flat.exp_avg.kind(), flat.exp_avg.device());
                g.members.iter().all(|&i| grads[i].defined() && grads[i].kind() == kind && grads[i].device() == device)
            })
        };
        if self.groups.is_empty() || !self.groups.iter().all(ready) {
            return false;
        }
        let mut takes = true;
        for group in &mut self.groups {
            let gs: Vec<Tensor> = group.members.iter().map(|&i| grads[i].shallow_clone()).collect();
            takes &= group.flat.as_mut().expect("ready").takes(&gs);
        }
        if !takes {
            return false;
        }
        let hypers: Vec<Hyper> = self.groups.iter().filter_map(|g| self.hyper(g.weight_decay)).collect();
        for (group, h) in self.groups.iter_mut().zip(hypers) {
            let pick = |of: &dyn Fn(usize) -> Tensor| group.members.iter().map(|&i| of(i)).collect::<Vec<_>>();
            let (ps, gs) = (pick(&|i| params[i].1.shallow_clone()), pick(&|i| grads[i].shallow_clone()));
            group.flat.as_mut().expect("ready").step(&ps, &gs, h, (lr, self.steps));
        }
        true
    }

    /// The element-wise rule of this step's update at rate `lr` for a parameter of weight decay
    /// `weight_decay`.
    pub(crate) fn rule(&self, weight_decay: f64, lr: f64) -> Rule {
        rule(&self.config, (weight_decay, lr), self.steps)
    }

    /// Its settings.
    pub(crate) fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Steps taken.
    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// Each parameter's rule at rate `lr` (of weight decay `decay`), with Keras's `clipnorm` of its
    /// gradient.
    fn rules(&self, decay: &[f64], params: &[(String, Tensor)], lr: f64) -> Vec<Rule> {
        let mut rules: Vec<Rule> = decay.iter().map(|&wd| self.rule(wd, lr)).collect();
        if let OptimizerConfig::Keras(KerasOptimizer { clipnorm: Some(clipnorm), .. }) = self.config {
            for (rule, (_, p)) in rules.iter_mut().zip(params) {
                keras_clip(rule, clipnorm, &p.grad());
            }
        }
        rules
    }

    /// Each parameter on its own.
    fn step_each(&mut self, params: &mut [(String, Tensor)], lr: f64) {
        let decay = per_parameter(&self.groups, params.len());
        let rules = self.rules(&decay, params, lr);
        for (i, ((_, p), slots)) in params.iter_mut().zip(self.slots.iter_mut()).enumerate() {
            let grad = p.grad();
            if !grad.defined() {
                continue;
            }
            let weight_decay = decay[i];
            if fused(&rules[i], p, &grad, slots) {
                continue;
            }
            match (&self.config, slots) {
                (OptimizerConfig::Keras(_), slots) => on_cpu(&rules[i], p, &grad, slots),
                (&OptimizerConfig::Sgd { momentum, dampening, nesterov, .. }, Slots::Sgd { momentum_buffer }) => {
                    sgd(
                        p,
                        adam::with_decay(grad, p, weight_decay),
                        momentum_buffer,
                        (momentum, dampening, nesterov),
                        lr,
                    );
                }
                (
                    OptimizerConfig::Adam { beta1, beta2, eps, .. } | OptimizerConfig::Adamw { beta1, beta2, eps, .. },
                    Slots::Adam { exp_avg, exp_avg_sq },
                ) => {
                    let decoupled = matches!(self.config, OptimizerConfig::Adamw { .. });
                    let h = Hyper { beta1: *beta1, beta2: *beta2, eps: *eps, weight_decay, decoupled };
                    adam::update(p, grad, (exp_avg, exp_avg_sq), h, lr, self.steps);
                }
                (
                    &OptimizerConfig::Rmsprop { alpha, eps, momentum, .. },
                    Slots::Rmsprop { square_avg, momentum_buffer, grad_avg },
                ) => {
                    let grad = adam::with_decay(grad, p, weight_decay);
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

/// Adam's hyper-parameters under `config` for a group of weight decay `weight_decay`; `None` for
/// the other optimizers.
fn hyper(config: &OptimizerConfig, weight_decay: f64) -> Option<Hyper> {
    match *config {
        OptimizerConfig::Adam { beta1, beta2, eps, .. } => {
            Some(Hyper { beta1, beta2, eps, weight_decay, decoupled: false })
        }
        OptimizerConfig::Adamw { beta1, beta2, eps, .. } => {
            Some(Hyper { beta1, beta2, eps, weight_decay, decoupled: true })
        }
        _ => None,
    }
}

/// The element-wise rule of `config`'s update number `steps` (1-based) at rate `lr` for a
/// parameter of weight decay `weight_decay`: every float32 CPU update's, sharded or not.
pub(crate) fn rule(config: &OptimizerConfig, (weight_decay, lr): (f64, f64), steps: u64) -> Rule {
    if let Some(h) = hyper(config, weight_decay) {
        return h.rule(lr, steps);
    }
    match *config {
        OptimizerConfig::Sgd { momentum, dampening, nesterov, .. } => Rule::Sgd {
            wd: weight_decay as f32,
            momentum: momentum as f32,
            keep: (1.0 - dampening) as f32,
            nesterov,
            neg_lr: -lr as f32,
        },
        OptimizerConfig::Rmsprop { alpha, eps, momentum, centered, .. } => Rule::Rmsprop {
            wd: weight_decay as f32,
            alpha: [alpha as f32, (1.0 - alpha) as f32],
            eps: eps as f32,
            momentum: (momentum > 0.0).then_some(momentum as f32),
            centered,
            neg_lr: -lr as f32,
        },
        OptimizerConfig::Keras(ref k) => keras_rule(k, (weight_decay, lr), steps),
        OptimizerConfig::Adam { .. } | OptimizerConfig::Adamw { .. } => unreachable!("Adam's rule is its hyper's"),
    }
}

/// Keras's rule of `k`'s update number `steps` (1-based) at rate `lr` for a parameter of weight
/// decay `weight_decay`, its scalars rounded to float32 where Keras holds them as float32 (the
/// learning rate is a float32 variable); no `clipnorm` ([`keras_clip`] adds it per parameter).
fn keras_rule(k: &KerasOptimizer, (weight_decay, lr): (f64, f64), steps: u64) -> Rule {
    let lr32 = lr as f32;
    let shrink = (weight_decay != 0.0).then_some(1.0 - weight_decay as f32 * lr32);
    match k.rule {
        KerasRule::Sgd { momentum, nesterov } => {
            Rule::KerasSgd { shrink, clip: None, momentum: momentum as f32, nesterov, neg_lr: -lr32 }
        }
        KerasRule::Adam { beta1, beta2, eps } | KerasRule::Adamw { beta1, beta2, eps } => {
            let t = steps as f32;
            let (power1, power2) = ((beta1 as f32).powf(t), (beta2 as f32).powf(t));
            Rule::KerasAdam {
                shrink,
                clip: None,
                betas: [beta1 as f32, (1.0 - beta1) as f32, beta2 as f32, (1.0 - beta2) as f32],
                eps: eps as f32,
                alpha: lr32 * (1.0 - power2).sqrt() / (1.0 - power1),
            }
        }
        KerasRule::Rmsprop { rho, momentum, eps, centered } => Rule::KerasRmsprop {
            shrink,
            clip: None,
            rho: [rho as f32, (1.0 - rho) as f32],
            eps: eps as f32,
            momentum: (momentum > 0.0).then_some(momentum as f32),
            centered,
            lr: lr32,
        },
    }
}

/// Adds Keras's `clipnorm` of the gradient `grad` to a Keras `rule`: its 2-norm as Keras takes it
/// (the float32 sum of the squares, its root).
fn keras_clip(rule: &mut Rule, clipnorm: f64, grad: &Tensor) {
    if !grad.defined() {
        return;
    }
    let c = clipnorm as f32;
    let norm = grad.square().sum(tch::Kind::Float).sqrt().double_value(&[]) as f32;
    let clip = Some(KerasClip { clipnorm: c, divisor: norm.max(c) });
    match rule {
        Rule::KerasSgd { clip: at, .. } | Rule::KerasAdam { clip: at, .. } | Rule::KerasRmsprop { clip: at, .. } => {
            *at = clip
        }
        _ => {}
    }
}

/// `rule`'s update of `p` from `grad` (a Keras rule) where the one-pass loop cannot run on them in
/// place (another device or kind): on float32 CPU copies, written back. The same bits as on the
/// CPU; Keras's models are small enough that the copies cost little.
fn on_cpu(rule: &Rule, p: &mut Tensor, grad: &Tensor, slots: &mut Slots) {
    let cpu = |t: &Tensor| t.to_device(tch::Device::Cpu).to_kind(tch::Kind::Float).contiguous().copy();
    let (mut p32, g32) = (cpu(p), cpu(grad));
    let mut state: Vec<&mut Tensor> = match slots {
        Slots::Sgd { momentum_buffer } => momentum_buffer.iter_mut().collect(),
        Slots::Adam { exp_avg, exp_avg_sq } => vec![exp_avg, exp_avg_sq],
        Slots::Rmsprop { square_avg, momentum_buffer, grad_avg } => {
            let mut v = vec![square_avg];
            v.extend(momentum_buffer.iter_mut());
            v.extend(grad_avg.iter_mut());
            v
        }
    };
    let mut copies: Vec<Tensor> = state.iter().map(|t| cpu(t)).collect();
    let done = elementwise::on_tensors(rule, &mut p32, &g32, &mut copies.iter_mut().collect::<Vec<_>>(), false);
    assert!(done, "float32 CPU copies of one length");
    tch::no_grad(|| {
        p.copy_(&p32);
        for (t, c) in state.iter_mut().zip(&copies) {
            t.copy_(c);
        }
    });
}

/// Each parameter's weight decay under `config` (its group's).
pub(crate) fn weight_decays(config: &OptimizerConfig, params: &[(String, Tensor)]) -> Vec<f64> {
    per_parameter(&groups(config, params), params.len())
}

/// The weight decay of each of `n` parameters, from its group.
fn per_parameter(groups: &[Group], n: usize) -> Vec<f64> {
    let mut decay = vec![0.0; n];
    for g in groups {
        g.members.iter().for_each(|&i| decay[i] = g.weight_decay);
    }
    decay
}

/// `rule`'s update of `p` from `grad` with its state `slots`, in one pass (float32 on the CPU;
/// SGD's momentum buffer made here at the first gradient); false (nothing done) for the others.
fn fused(rule: &Rule, p: &mut Tensor, grad: &Tensor, slots: &mut Slots) -> bool {
    if !elementwise::plain(p) || !elementwise::plain(grad) {
        return false;
    }
    match slots {
        Slots::Sgd { momentum_buffer } => {
            let first = momentum_buffer.is_none();
            if first && rule.state_len() == 1 {
                *momentum_buffer = Some(p.zeros_like());
            }
            elementwise::on_tensors(rule, p, grad, &mut momentum_buffer.iter_mut().collect::<Vec<_>>(), first)
        }
        Slots::Adam { exp_avg, exp_avg_sq } => {
            elementwise::on_tensors(rule, p, grad, &mut [exp_avg, exp_avg_sq], false)
        }
        Slots::Rmsprop { square_avg, momentum_buffer, grad_avg } => {
            let mut state = vec![square_avg];
            state.extend(momentum_buffer.iter_mut());
            state.extend(grad_avg.iter_mut());
            elementwise::on_tensors(rule, p, grad, &mut state, false)
        }
    }
}

/// SGD's update of `p` by `d_p` (its gradient with the L2 penalty), PyTorch's rule.
fn sgd(
    p: &mut Tensor,
    mut d_p: Tensor,
    buffer: &mut Option<Tensor>,
    (momentum, dampening, nesterov): (f64, f64, bool),
    lr: f64,
) {
    if momentum != 0.0 {
        let buf = match buffer {
            Some(buf) => {
                let _ = buf.g_mul_scalar_(momentum).g_add_(&(&d_p * (1.0 - dampening)));
                buf
            }
            None => buffer.insert(d_p.detach().copy()),
        };
        d_p = if nesterov { d_p + &*buf * momentum } else { buf.shallow_clone() };
    }
    let _ = p.g_add_(&(d_p * -lr));
}

mod ranged;

#[cfg(test)]
mod keras_tests;
#[cfg(test)]
mod tests;
