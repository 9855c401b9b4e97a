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

/// What an update stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// The parameters and the state.
    Both,
    /// The new parameters only (where the update's [`Params`] puts them).
    Params,
    /// The state only.
    State,
}

impl Write {
    fn params(self) -> bool {
        self != Write::State
    }

    fn state(self) -> bool {
        self != Write::Params
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
    /// or into another slice: [`ReadInto`]); what is stored follows `write`.
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
        let (wp, ws) = (write.params(), write.state());
        match *self {
            Rule::Sgd { wd, momentum, keep, nesterov, neg_lr } => {
                // Loops without branches or indexing, as Adam's below (the same bits).
                let decayed = move |pi: f32, gi: f32| if wd != 0.0 { gi + pi * wd } else { gi };
                match state {
                    [buf] => p.each1(g, buf, write, |pi, gi, bi| {
                        let d = decayed(pi, gi);
                        let buf = if first { d } else { bi * momentum + d * keep };
                        let d = if nesterov { d + buf * momentum } else { buf };
                        (pi + d * neg_lr, buf)
                    }),
                    _ if wp => p.each0(g, |pi, gi| pi + decayed(pi, gi) * neg_lr),
                    _ => {}
                }
            }
            Rule::Adam { shrink, wd, betas: [b1, one_b1, b2, one_b2], eps, step_size, bias2_sqrt } => {
                let [m, v] = state else { unreachable!("Adam's two state slices") };
                // One loop without branches or indexing, which the compiler vectorizes (the
                // same operations on each element, in the same order: the same bits).
                p.each2(Lanes2 { g, a: m, b: v }, write, |pi, gi, mi, vi| {
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
            Rule::Rmsprop { .. } => self.rmsprop(p, g, state, (wp, ws)),
            Rule::KerasSgd { .. } | Rule::KerasAdam { .. } | Rule::KerasRmsprop { .. } => {
                self.keras(p, g, state, write)
            }
        }
    }

    /// RMSprop's loop ([`Rule::apply`]'s, for this rule).
    fn rmsprop(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], (wp, ws): (bool, bool)) {
        let Rule::Rmsprop { wd, alpha: [alpha, one_alpha], eps, momentum, centered, neg_lr } = *self else {
            unreachable!("RMSprop's rule")
        };
        let n = p.len();
        let (buf_at, avg_at) = (1, 1 + usize::from(momentum.is_some()));
        for i in 0..n {
            let pi = p.read(i);
            let grad = if wd != 0.0 { g[i] + pi * wd } else { g[i] };
            let square = state[0][i] * alpha + grad * one_alpha * grad;
            let avg = if centered {
                let grad_avg = state[avg_at][i] * alpha + grad * one_alpha;
                if ws {
                    state[avg_at][i] = grad_avg;
                }
                (square - grad_avg * grad_avg).sqrt() + eps
            } else {
                square.sqrt() + eps
            };
            if ws {
                state[0][i] = square;
            }
            let new = match momentum {
                Some(m) => {
                    let buf = state[buf_at][i] * m + grad / avg;
                    if ws {
                        state[buf_at][i] = buf;
                    }
                    pi + buf * neg_lr
                }
                None => pi + grad * neg_lr / avg,
            };
            if wp {
                p.write(i, new);
            }
        }
    }

    /// Keras's loops ([`Rule::apply`]'s, for these rules): each operation as Keras's PyTorch
    /// backend runs it, one float32 rounding each.
    fn keras(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], write: Write) {
        let (wp, ws) = (write.params(), write.state());
        match *self {
            Rule::KerasSgd { .. } => self.keras_sgd(p, g, state, (wp, ws)),
            Rule::KerasAdam { shrink, clip, betas: [b1, one_b1, b2, one_b2], eps, alpha } => {
                let [m, v] = state else { unreachable!("Adam's two state slices") };
                // One loop the compiler vectorizes, as Adam's (the same bits).
                p.each2(Lanes2 { g, a: m, b: v }, write, |pi, gi, mi, vi| {
                    let (pi, grad) = (shrunk(shrink, pi), KerasClip::apply(clip, gi));
                    let m = mi * b1 + one_b1 * grad;
                    let v = vi * b2 + one_b2 * (grad * grad);
                    (pi - (m * alpha) / (v.sqrt() + eps), m, v)
                });
            }
            Rule::KerasRmsprop { .. } => self.keras_rmsprop(p, g, state, (wp, ws)),
            _ => unreachable!("Keras's rules"),
        }
    }

    /// Keras's SGD loop.
    fn keras_sgd(&self, p: &mut (impl Params + ?Sized), g: &[f32], state: &mut [&mut [f32]], (wp, ws): (bool, bool)) {
        let Rule::KerasSgd { shrink, clip, momentum, nesterov, neg_lr } = *self else { unreachable!("Keras's SGD") };
        for i in 0..p.len() {
            let (pi, grad) = (shrunk(shrink, p.read(i)), KerasClip::apply(clip, g[i]));
            let new = if momentum != 0.0 {
                let m = state[0][i] * momentum + neg_lr * grad;
                if ws {
                    state[0][i] = m;
                }
                if nesterov {
                    (pi + neg_lr * grad) + momentum * m
                } else {
                    pi + m
                }
            } else {
                pi + neg_lr * grad
            };
            if wp {
                p.write(i, new);
            }
        }
    }

    /// Keras's RMSprop loop.
    fn keras_rmsprop(
        &self,
        p: &mut (impl Params + ?Sized),
        g: &[f32],
        state: &mut [&mut [f32]],
        (wp, ws): (bool, bool),
    ) {
        let Rule::KerasRmsprop { shrink, clip, rho: [rho, one_rho], eps, momentum, centered, lr } = *self else {
            unreachable!("Keras's RMSprop")
        };
        let (mom_at, avg_at) = (1, 1 + usize::from(momentum.is_some()));
        for i in 0..p.len() {
            let (pi, grad) = (shrunk(shrink, p.read(i)), KerasClip::apply(clip, g[i]));
            let v = state[0][i] * rho + one_rho * (grad * grad);
            let mut denom = v + eps;
            if centered {
                let a = state[avg_at][i] * rho + one_rho * grad;
                if ws {
                    state[avg_at][i] = a;
                }
                denom -= a * a;
            }
            if ws {
                state[0][i] = v;
            }
            let increment = (grad * lr) / denom.sqrt();
            let new = match momentum {
                Some(mo) => {
                    let o = state[mom_at][i] * mo + increment;
                    if ws {
                        state[mom_at][i] = o;
                    }
                    pi - o
                }
                None => pi - increment,
            };
            if wp {
                p.write(i, new);
            }
        }
    }
}

/// `p` shrunk by Keras's decoupled weight decay, when it has one.
fn shrunk(shrink: Option<f32>, p: f32) -> f32 {
    shrink.map_or(p, |s| p * s)
}

/// The parameter values an update reads, and where it puts the new ones: a slice, read and
/// written in place, or [`ReadInto`].
pub(crate) trait Params {
    /// How many values.
    fn len(&self) -> usize;
    /// Value `i` as the update reads it.
    fn read(&self, i: usize) -> f32;
    /// The new value `i`.
    fn write(&mut self, i: usize, value: f32);
    /// Runs `f` on every element, (parameter, gradient, its two state values) to (new parameter,
    /// new state values), and stores what `write` says: one loop over the slices together, which
    /// the compiler can vectorize (a rule of two state slices, Adam's).
    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2);
    /// The same for a rule of one state slice `a` (SGD's momentum): (parameter, gradient, state
    /// value) to (new parameter, new state value).
    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32));
    /// The same for a rule without state: (parameter, gradient) to the new parameter, written.
    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32);
}

/// A new parameter value and two new state values.
pub(crate) type Step2 = (f32, f32, f32);

/// The slices a rule of two state slices runs over: the gradient and the two state slices.
pub(crate) struct Lanes2<'s> {
    pub(crate) g: &'s [f32],
    pub(crate) a: &'s mut [f32],
    pub(crate) b: &'s mut [f32],
}

impl<'s> Lanes2<'s> {
    /// The slices cut to `n` elements each (so that the loops over them check no index).
    fn cut(self, n: usize) -> (&'s [f32], &'s mut [f32], &'s mut [f32]) {
        (&self.g[..n], &mut self.a[..n], &mut self.b[..n])
    }
}

/// [`Params::each2`] storing the state alone: the parameters `p` are only read.
fn store2(p: &[f32], lanes: Lanes2<'_>, f: impl Fn(f32, f32, f32, f32) -> Step2) {
    let (g, a, b) = lanes.cut(p.len());
    for (((&p, &g), a), b) in p.iter().zip(g).zip(a.iter_mut()).zip(b.iter_mut()) {
        (_, *a, *b) = f(p, g, *a, *b);
    }
}

/// [`Params::each1`] storing the state alone: the parameters `p` are only read.
fn store1(p: &[f32], g: &[f32], a: &mut [f32], f: impl Fn(f32, f32, f32) -> (f32, f32)) {
    let (g, a) = (&g[..p.len()], &mut a[..p.len()]);
    for ((&p, &g), a) in p.iter().zip(g).zip(a.iter_mut()) {
        *a = f(p, g, *a).1;
    }
}

impl Params for [f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    fn read(&self, i: usize) -> f32 {
        self[i]
    }

    fn write(&mut self, i: usize, value: f32) {
        self[i] = value;
    }

    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2) {
        let (g, a, b) = lanes.cut(self.len());
        match write {
            Write::Both => {
                for (((p, &g), a), b) in self.iter_mut().zip(g).zip(a.iter_mut()).zip(b.iter_mut()) {
                    (*p, *a, *b) = f(*p, g, *a, *b);
                }
            }
            Write::Params => {
                for (((p, &g), &a), &b) in self.iter_mut().zip(g).zip(a.iter()).zip(b.iter()) {
                    *p = f(*p, g, a, b).0;
                }
            }
            Write::State => store2(self, Lanes2 { g, a, b }, f),
        }
    }

    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32)) {
        let (g, a) = (&g[..self.len()], &mut a[..self.len()]);
        match write {
            Write::Both => {
                for ((p, &g), a) in self.iter_mut().zip(g).zip(a.iter_mut()) {
                    (*p, *a) = f(*p, g, *a);
                }
            }
            Write::Params => {
                for ((p, &g), &a) in self.iter_mut().zip(g).zip(a.iter()) {
                    *p = f(*p, g, a).0;
                }
            }
            Write::State => store1(self, g, a, f),
        }
    }

    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32) {
        let g = &g[..self.len()];
        for (p, &g) in self.iter_mut().zip(g) {
            *p = f(*p, g);
        }
    }
}

/// Parameter values read from one slice, borrowed where they lie (a sharded update reads them
/// from the parameter itself), with the new values written into another (the all-gather's
/// buffer), or nowhere when the update stores its state alone ([`Write::State`]).
pub(crate) struct ReadInto<'a> {
    from: &'a [f32],
    to: Option<&'a mut [f32]>,
}

impl<'a> ReadInto<'a> {
    /// Reads `from`, writes into `to` (as long), if given.
    pub(crate) fn new(from: &'a [f32], to: Option<&'a mut [f32]>) -> Self {
        assert!(to.as_ref().is_none_or(|to| to.len() == from.len()), "as many new values as read");
        ReadInto { from, to }
    }
}

impl Params for ReadInto<'_> {
    fn len(&self) -> usize {
        self.from.len()
    }

    fn read(&self, i: usize) -> f32 {
        self.from[i]
    }

    fn write(&mut self, i: usize, value: f32) {
        self.to.as_deref_mut().expect("an update that writes parameters has a place for them")[i] = value;
    }

    fn each2(&mut self, lanes: Lanes2<'_>, write: Write, f: impl Fn(f32, f32, f32, f32) -> Step2) {
        if write == Write::State {
            return store2(self.from, lanes, f);
        }
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        let (g, a, b) = lanes.cut(self.from.len());
        let values = self.from.iter().zip(to.iter_mut()).zip(g);
        match write {
            Write::Params => {
                for (((&p, to), &g), (&a, &b)) in values.zip(a.iter().zip(b.iter())) {
                    *to = f(p, g, a, b).0;
                }
            }
            _ => {
                for (((&p, to), &g), (a, b)) in values.zip(a.iter_mut().zip(b.iter_mut())) {
                    (*to, *a, *b) = f(p, g, *a, *b);
                }
            }
        }
    }

    fn each1(&mut self, g: &[f32], a: &mut [f32], write: Write, f: impl Fn(f32, f32, f32) -> (f32, f32)) {
        if write == Write::State {
            return store1(self.from, g, a, f);
        }
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        let n = self.from.len();
        let values = self.from.iter().zip(to.iter_mut()).zip(&g[..n]);
        match write {
            Write::Params => {
                for (((&p, to), &g), &a) in values.zip(&a[..n]) {
                    *to = f(p, g, a).0;
                }
            }
            _ => {
                for (((&p, to), &g), a) in values.zip(a[..n].iter_mut()) {
                    (*to, *a) = f(p, g, *a);
                }
            }
        }
    }

    fn each0(&mut self, g: &[f32], f: impl Fn(f32, f32) -> f32) {
        let to = self.to.as_deref_mut().expect("an update that writes parameters has a place for them");
        for ((&p, to), &g) in self.from.iter().zip(to.iter_mut()).zip(&g[..self.from.len()]) {
            *to = f(p, g);
        }
    }
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
