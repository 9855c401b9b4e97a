//! Every optimizer's float32 update as one element-wise loop: PyTorch's rules, each operation
//! rounded to float32 as libtorch's CPU kernels round it (the scalar cast to float32 first, no
//! fused multiply-add), in one pass over memory. Because each element's arithmetic depends on
//! nothing but that element, the update of any slice is the update of the whole restricted to
//! the slice: what lets a member update only the element ranges it owns
//! (`--shard-optimizer`, [`super::sharded`]) and still give the unsharded run's bits.
//!
//! The update can run in two passes over the same values ([`Write`]): first the new parameters
//! alone (the state untouched), then the state alone (the parameters untouched). Both passes
//! compute the same thing, so storing in two passes gives the bits of storing in one.

use super::lanes::{Lanes2, Lanes3, Params, Step3, Write};

/// One group's update rule at one step: the hyper-parameters, the learning rate and (for Adam)
/// the bias corrections, as float32 where the kernels use them as float32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Rule {
    /// SGD: `d = g + wd·p`; with momentum, `buf = buf·m + d·(1 - dampening)` (`buf = d` at a
    /// parameter's first gradient) and `d = d + buf·m` (Nesterov) or `buf`; `p = p + d·(-lr)`.
    /// State: `[momentum_buffer]` when `momentum` is not 0, else none.
    Sgd {
        /// L2 weight decay.
        wd: f32,
        /// Momentum (0: none).
        momentum: f32,
        /// `1 - dampening`.
        keep: f32,
        /// Nesterov momentum.
        nesterov: bool,
        /// `-lr`.
        neg_lr: f32,
    },
    /// Adam and AdamW. State: `[exp_avg, exp_avg_sq]`.
    Adam {
        /// AdamW's `1 - lr·wd`, by which the parameter is multiplied first; `None` for Adam.
        shrink: Option<f32>,
        /// Adam's L2 weight decay (0 for AdamW).
        wd: f32,
        /// `beta1`, `1 - beta1`, `beta2`, `1 - beta2`.
        betas: [f32; 4],
        /// Epsilon.
        eps: f32,
        /// `-lr / (1 - beta1^t)`.
        step_size: f32,
        /// `sqrt(1 - beta2^t)`.
        bias2_sqrt: f32,
    },
    /// RMSprop. State: `[square_avg]`, then `momentum_buffer` when `momentum` is set, then
    /// `grad_avg` when centered.
    Rmsprop {
        /// L2 weight decay.
        wd: f32,
        /// `alpha`, `1 - alpha`.
        alpha: [f32; 2],
        /// Epsilon.
        eps: f32,
        /// Momentum, when not 0.
        momentum: Option<f32>,
        /// Centered: the variance rather than the second moment.
        centered: bool,
        /// `-lr`.
        neg_lr: f32,
    },
    /// Keras's SGD (Keras 3 on PyTorch): `g` clipped ([`KerasClip`]), `p` shrunk by the decoupled
    /// decay, then with momentum `m = m·momentum + g·(-lr)` and `p = p + g·(-lr) + m·momentum`
    /// (Nesterov) or `p = p + m`; without, `p = p + g·(-lr)`. State: `[momentum]` when `momentum` is
    /// not 0 (zeros at the start, as Keras makes it).
    KerasSgd {
        /// `1 - weight_decay·lr`, by which a decayed parameter is multiplied first.
        shrink: Option<f32>,
        /// `clipnorm`'s scaling of this parameter's gradient.
        clip: Option<KerasClip>,
        /// Momentum (0: none).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
        /// `-lr`.
        neg_lr: f32,
    },
    /// Keras's Adam and AdamW: `m = m·β₁ + g·(1-β₁)`, `v = v·β₂ + g²·(1-β₂)`, `p = p - m·α / (√v +
    /// ε)`, after the clipping and the shrink as [`Rule::KerasSgd`]. State: `[m, v]`.
    KerasAdam {
        /// As [`Rule::KerasSgd`]'s.
        shrink: Option<f32>,
        /// As [`Rule::KerasSgd`]'s.
        clip: Option<KerasClip>,
        /// `beta1`, `1 - beta1`, `beta2`, `1 - beta2`.
        betas: [f32; 4],
        /// Epsilon.
        eps: f32,
        /// `lr·√(1-β₂ᵗ)/(1-β₁ᵗ)`, in float32 as Keras computes it.
        alpha: f32,
    },
    /// Keras's RMSprop: `v = v·ρ + g²·(1-ρ)`, `d = v + ε` (centered: `a = a·ρ + g·(1-ρ)`, `d = d -
    /// a²`), `i = g·lr / √d`; with momentum `o = o·momentum + i`, `p = p - o`, else `p = p - i`.
    /// State: `[v]`, then `o` with momentum, then `a` when centered.
    KerasRmsprop {
        /// As [`Rule::KerasSgd`]'s.
        shrink: Option<f32>,
        /// As [`Rule::KerasSgd`]'s.
        clip: Option<KerasClip>,
        /// `rho`, `1 - rho`.
        rho: [f32; 2],
        /// Epsilon.
        eps: f32,
        /// Momentum, when not 0.
        momentum: Option<f32>,
        /// Centered.
        centered: bool,
        /// `lr`.
        lr: f32,
    },
}

/// Keras's `clipnorm` of one variable's gradient: `g·clipnorm / max(‖g‖, clipnorm)`, applied
/// whatever the norm (as Keras does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KerasClip {
    /// `clipnorm`.
    pub(crate) clipnorm: f32,
    /// `max(‖g‖, clipnorm)`.
    pub(crate) divisor: f32,
}

impl KerasClip {
    fn apply(clip: Option<KerasClip>, g: f32) -> f32 {
        match clip {
            Some(c) => g * c.clipnorm / c.divisor,
            None => g,
        }
    }
}

impl Rule {
    /// How many state slices the rule takes.
    pub(crate) fn state_len(&self) -> usize {
        match *self {
            Rule::Sgd { momentum, .. } => usize::from(momentum != 0.0),
            Rule::Adam { .. } => 2,
            Rule::Rmsprop { momentum, centered, .. } | Rule::KerasRmsprop { momentum, centered, .. } => {
                1 + usize::from(momentum.is_some()) + usize::from(centered)
            }
            Rule::KerasSgd { momentum, .. } => usize::from(momentum != 0.0),
            Rule::KerasAdam { .. } => 2,
        }
    }

    /// Updates the elements of `p` from the gradient `g` and `state` (one slice per
    /// [`Rule::state_len`], each as long as `p`). `first`: the parameter's first gradient (SGD
    /// makes its momentum buffer from it). The new parameters go where `p` puts them (in place,
    /// or into another slice: [`ReadInto`](super::lanes::ReadInto)); what is stored follows `write`.
    pub(crate) fn apply(
        &self,
        p: &mut (impl Params + ?Sized),
        g: &[f32],
        state: &mut [&mut [f32]],
        first: bool,
        write: Write,
    ) {
        let n = p.len();
        assert!(g.len() == n && state.len() == self.state_len(), "slices of one length, one per state tensor");
        assert!(state.iter().all(|s| s.len() == n));
        match *self {
            Rule::Sgd { wd, momentum, keep, nesterov, neg_lr } => {
                // Loops without branches or indexing, as Adam's below (the same bits).
                let decayed = move |pi: f32, gi: f32| if wd != 0.0 { gi + pi * wd } else { gi };
                match state {
                    [buf] => p.each1(g, buf, write, move |pi, gi, bi| {
                        let d = decayed(pi, gi);
                        let buf = if first { d } else { bi * momentum + d * keep };
                        let d = if nesterov { d + buf * momentum } else { buf };
                        (pi + d * neg_lr, buf)
                    }),
                    _ if write != Write::State => p.each0(g, move |pi, gi| pi + decayed(pi, gi) * neg_lr),
                    _ => {}
                }
            }
            Rule::Adam { shrink, wd, betas: [b1, one_b1, b2, one_b2], eps, step_size, bias2_sqrt } => {
                let [m, v] = state else { unreachable!("Adam's two state slices") };
                // One loop without branches or indexing, which the compiler vectorizes (the
                // same operations on each element, in the same order: the same bits).
                p.each2(Lanes2 { g, a: m, b: v }, write, move |pi, gi, mi, vi| {
                    let pi = match shrink {
                        Some(shrink) => pi * shrink,
                        None => pi,
                    };
                    let grad = if wd == 0.0 { gi } else { gi + pi * wd };
                    let m = mi * b1 + grad * one_b1;
                    let v = vi * b2 + grad * one_b2 * grad;
                    let denom = v.sqrt() / bias2_sqrt + eps;
                    (pi + m * step_size / denom, m, v)
                });
            }
            Rule::Rmsprop { .. } => self.rmsprop(p, g, state, write),
            Rule::KerasSgd { .. } | Rule::KerasAdam { .. } | Rule::KerasRmsprop { .. } => {
                self.keras(p, g, state, write)
            }
        }
    }

    /// RMSprop's loop ([`Rule::apply`]'s, for this rule).
    fn rmsprop(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], write: Write) {
        let Rule::Rmsprop { wd, alpha: [alpha, one_alpha], eps, momentum, centered, neg_lr } = *self else {
            unreachable!("RMSprop's rule")
        };
        each_of_three(p, g, state, write, momentum.is_some(), move |pi, gi, [square, buf, grad_avg]| {
            let grad = if wd != 0.0 { gi + pi * wd } else { gi };
            let square = square * alpha + grad * one_alpha * grad;
            let grad_avg = grad_avg * alpha + grad * one_alpha;
            let avg = if centered { (square - grad_avg * grad_avg).sqrt() + eps } else { square.sqrt() + eps };
            match momentum {
                Some(m) => {
                    let buf = buf * m + grad / avg;
                    (pi + buf * neg_lr, [square, buf, grad_avg])
                }
                None => (pi + grad * neg_lr / avg, [square, buf, grad_avg]),
            }
        });
    }

    /// Keras's loops ([`Rule::apply`]'s, for these rules): each operation as Keras's PyTorch
    /// backend runs it, one float32 rounding each.
    fn keras(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], write: Write) {
        match *self {
            Rule::KerasSgd { shrink, clip, momentum, nesterov, neg_lr } => match state {
                [m] => p.each1(g, m, write, move |pi, gi, mi| {
                    let (pi, grad) = (shrunk(shrink, pi), KerasClip::apply(clip, gi));
                    let m = mi * momentum + neg_lr * grad;
                    (if nesterov { (pi + neg_lr * grad) + momentum * m } else { pi + m }, m)
                }),
                _ if write != Write::State => {
                    p.each0(g, move |pi, gi| shrunk(shrink, pi) + neg_lr * KerasClip::apply(clip, gi))
                }
                _ => {}
            },
            Rule::KerasAdam { shrink, clip, betas: [b1, one_b1, b2, one_b2], eps, alpha } => {
                let [m, v] = state else { unreachable!("Adam's two state slices") };
                // One loop the compiler vectorizes, as Adam's (the same bits).
                p.each2(Lanes2 { g, a: m, b: v }, write, move |pi, gi, mi, vi| {
                    let (pi, grad) = (shrunk(shrink, pi), KerasClip::apply(clip, gi));
                    let m = mi * b1 + one_b1 * grad;
                    let v = vi * b2 + one_b2 * (grad * grad);
                    (pi - (m * alpha) / (v.sqrt() + eps), m, v)
                });
            }
            Rule::KerasRmsprop { .. } => self.keras_rmsprop(p, g, state, write),
            _ => unreachable!("Keras's rules"),
        }
    }

    /// Keras's RMSprop loop.
    fn keras_rmsprop(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], write: Write) {
        let Rule::KerasRmsprop { shrink, clip, rho: [rho, one_rho], eps, momentum, centered, lr } = *self else {
            unreachable!("Keras's RMSprop")
        };
        each_of_three(p, g, state, write, momentum.is_some(), move |pi, gi, [v, o, a]| {
            let (pi, grad) = (shrunk(shrink, pi), KerasClip::apply(clip, gi));
            let v = v * rho + one_rho * (grad * grad);
            let a = a * rho + one_rho * grad;
            let denom = if centered { (v + eps) - a * a } else { v + eps };
            let increment = (grad * lr) / denom.sqrt();
            match momentum {
                Some(mo) => {
                    let o = o * mo + increment;
                    (pi - o, [v, o, a])
                }
                None => (pi - increment, [v, o, a]),
            }
        });
    }
}

/// Runs `f`, a rule of a first state value and up to two more (the second when `second`, the
/// third when the state has one more slice: RMSprop's momentum buffer and average gradient), over
/// the state slices the rule has, in one loop without branches or indexing (a value the rule has
/// not reaches `f` as 0 and is dropped).
fn each_of_three(
    p: &mut (impl Params + ?Sized),
    g: &[f32],
    state: &mut [&mut [f32]],
    write: Write,
    second: bool,
    f: impl Fn(f32, f32, [f32; 3]) -> Step3,
) {
    match state {
        [a] => p.each1(g, a, write, move |pi, gi, a| {
            let (new, [a, ..]) = f(pi, gi, [a, 0.0, 0.0]);
            (new, a)
        }),
        [a, b] if second => p.each2(Lanes2 { g, a, b }, write, move |pi, gi, a, b| {
            let (new, [a, b, _]) = f(pi, gi, [a, b, 0.0]);
            (new, a, b)
        }),
        [a, c] => p.each2(Lanes2 { g, a, b: c }, write, move |pi, gi, a, c| {
            let (new, [a, _, c]) = f(pi, gi, [a, 0.0, c]);
            (new, a, c)
        }),
        [a, b, c] => p.each3(Lanes3 { g, state: [a, b, c] }, write, f),
        _ => unreachable!("one to three state slices"),
    }
}

/// `p` shrunk by Keras's decoupled weight decay, when it has one.
fn shrunk(shrink: Option<f32>, p: f32) -> f32 {
    shrink.map_or(p, |s| p * s)
}

/// Whether `t` is a contiguous float32 CPU tensor: what the one-pass loop reads and writes in
/// place, as a slice of its memory.
pub(crate) fn plain(t: &tch::Tensor) -> bool {
    t.kind() == tch::Kind::Float && t.device() == tch::Device::Cpu && t.is_contiguous()
}

/// A [`plain`] tensor's elements, borrowed where they lie (`None` for any other tensor).
pub(crate) fn host_f32(t: &tch::Tensor) -> Option<&[f32]> {
    // SAFETY: a contiguous float32 host tensor of `numel` elements, only read while `t` is
    // borrowed.
    plain(t).then(|| unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, t.numel()) })
}

/// [`Rule::apply`] on tensors, in place, storing both: `p`, its gradient and its state tensors
/// (one per [`Rule::state_len`]). False (nothing done) unless every one is a distinct
/// contiguous float32 CPU tensor of `p`'s length; those take libtorch's kernels.
pub(crate) fn on_tensors(
    rule: &Rule,
    p: &mut tch::Tensor,
    grad: &tch::Tensor,
    state: &mut [&mut tch::Tensor],
    first: bool,
) -> bool {
    let n = p.numel();
    let all: Vec<&tch::Tensor> = [&*p, grad].into_iter().chain(state.iter().map(|s| &**s)).collect();
    if state.len() != rule.state_len() || !all.iter().all(|t| plain(t) && t.numel() == n) {
        return false;
    }
    let ptrs: Vec<usize> = all.iter().map(|t| t.data_ptr() as usize).collect();
    if (1..ptrs.len()).any(|i| ptrs[..i].contains(&ptrs[i])) {
        return false; // aliased: leave it to the kernels
    }
    // SAFETY: distinct contiguous float32 CPU tensors of `n` elements, checked above; the slices
    // live only in this function, and nothing else runs on these tensors meanwhile.
    let p = unsafe { std::slice::from_raw_parts_mut(p.data_ptr() as *mut f32, n) };
    // SAFETY: as above; the gradient is only read.
    let g = unsafe { std::slice::from_raw_parts(grad.data_ptr() as *const f32, n) };
    let mut slices: Vec<&mut [f32]> = state
        .iter_mut()
        // SAFETY: as above.
        .map(|s| unsafe { std::slice::from_raw_parts_mut(s.data_ptr() as *mut f32, n) })
        .collect();
    rule.apply(p, g, &mut slices, first, Write::Both);
    true
}
