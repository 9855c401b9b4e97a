//! Adam's and AdamW's arithmetic: the update of one tensor (PyTorch's rules), a single pass over
//! memory for float32 on the CPU, and the flat buffers that let one update cover a whole group
//! of parameters.

use tch::{Device, Kind, Tensor};

/// Adam's hyper-parameters for one group of parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Hyper {
    pub(super) beta1: f64,
    pub(super) beta2: f64,
    pub(super) eps: f64,
    /// The group's weight decay.
    pub(super) weight_decay: f64,
    /// AdamW's decoupled decay (`p *= 1 - lr * weight_decay` first), not Adam's L2 penalty.
    pub(super) decoupled: bool,
}

impl Hyper {
    /// The L2 penalty added to the gradient (Adam's), 0 for AdamW.
    fn l2(&self) -> f64 {
        if self.decoupled {
            0.0
        } else {
            self.weight_decay
        }
    }

    /// What the parameter is multiplied by before the update at `lr` (AdamW's), 1 for Adam.
    fn shrink(&self, lr: f64) -> f64 {
        if self.decoupled {
            1.0 - lr * self.weight_decay
        } else {
            1.0
        }
    }
}

/// Adam's (or AdamW's) update of `p` at step `t` (1-based), in place.
pub(super) fn update(
    p: &mut Tensor,
    grad: Tensor,
    (exp_avg, exp_avg_sq): (&mut Tensor, &mut Tensor),
    h: Hyper,
    lr: f64,
    t: u64,
) {
    let t = t as i32;
    let bias1 = 1.0 - h.beta1.powi(t);
    let bias2 = 1.0 - h.beta2.powi(t);
    if fused(p, &grad, (exp_avg, exp_avg_sq), h, (h.shrink(lr), -lr / bias1, bias2.sqrt())) {
        return;
    }
    if h.shrink(lr) != 1.0 {
        let _ = p.g_mul_scalar_(h.shrink(lr));
    }
    let grad = with_decay(grad, p, h.l2());
    let _ = exp_avg.g_mul_scalar_(h.beta1).g_add_(&(&grad * (1.0 - h.beta1)));
    let _ = exp_avg_sq.g_mul_scalar_(h.beta2).addcmul_(&(&grad * (1.0 - h.beta2)), &grad);
    let denom = exp_avg_sq.sqrt() / bias2.sqrt() + h.eps;
    let _ = p.addcdiv_(&(&*exp_avg * (-lr / bias1)), &denom);
}

/// `grad + weight_decay * param` (L2 penalty), as PyTorch adds it.
pub(super) fn with_decay(grad: Tensor, param: &Tensor, weight_decay: f64) -> Tensor {
    if weight_decay == 0.0 {
        grad
    } else {
        grad + param * weight_decay
    }
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
fn fused(
    p: &mut Tensor,
    grad: &Tensor,
    (exp_avg, exp_avg_sq): (&mut Tensor, &mut Tensor),
    h: Hyper,
    (shrink, step_size, bias2_sqrt): (f64, f64, f64),
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
    let (b1, one_b1, b2, one_b2) = (h.beta1 as f32, (1.0 - h.beta1) as f32, h.beta2 as f32, (1.0 - h.beta2) as f32);
    let (l2, decays, shrink_f) = (h.l2(), shrink != 1.0, shrink as f32);
    let (eps, wd, step_size, bias2_sqrt) = (h.eps as f32, l2 as f32, step_size as f32, bias2_sqrt as f32);
    for i in 0..n {
        if decays {
            p[i] *= shrink_f;
        }
        let grad = if l2 == 0.0 { g[i] } else { g[i] + p[i] * wd };
        m[i] = m[i] * b1 + grad * one_b1;
        v[i] = v[i] * b2 + grad * one_b2 * grad;
        let denom = v[i].sqrt() / bias2_sqrt + eps;
        p[i] += m[i] * step_size / denom;
    }
    true
}

/// Adam over flat buffers, for one group of parameters: its state, the parameters and their
/// gradients each live in one tensor, and every parameter (and its gradient, once it has one)
/// is a view into it, as PyTorch's `p.data = flat[a:b].view_as(p)` makes it. One update of the
/// whole group is then a dozen kernels rather than a dozen per parameter: on a GPU the
/// launches, not the arithmetic, are what a small model's optimizer costs.
#[derive(Debug)]
pub(super) struct FlatAdam {
    pub(super) exp_avg: Tensor,
    pub(super) exp_avg_sq: Tensor,
    pub(super) params: Tensor,
    /// Made at the first step, from the gradients the first backward produced.
    pub(super) grads: Option<Tensor>,
    /// Each parameter's element count, in order.
    numels: Vec<i64>,
}

impl FlatAdam {
    /// Zero state for `params` (which become views of its parameter buffer), when they can
    /// share flat buffers (one kind, one device, contiguous); `None` otherwise.
    pub(super) fn new(params: &[Tensor]) -> Option<FlatAdam> {
        let first = params.first()?;
        let numels = params
            .iter()
            .map(|p| {
                (p.kind() == first.kind() && p.device() == first.device() && p.is_contiguous())
                    .then(|| p.numel() as i64)
            })
            .collect::<Option<Vec<i64>>>()?;
        let zeros = || Tensor::zeros([numels.iter().sum::<i64>()], (first.kind(), first.device()));
        let mut flat = FlatAdam { exp_avg: zeros(), exp_avg_sq: zeros(), params: Tensor::new(), grads: None, numels };
        flat.params = flat.alias(None, params);
        Some(flat)
    }

    /// The views of `flat` that stand for each parameter (of shapes `like`'s).
    pub(super) fn views(&self, flat: &Tensor, like: &[Tensor]) -> Vec<Tensor> {
        let mut at = 0;
        like.iter()
            .zip(&self.numels)
            .map(|(p, &n)| {
                let view = flat.narrow(0, at, n).view(p.size().as_slice());
                at += n;
                view
            })
            .collect()
    }

    /// Whether each of `tensors` is the matching view of `flat`.
    pub(super) fn aliases(&self, flat: &Tensor, tensors: &[Tensor]) -> bool {
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
    pub(super) fn alias(&self, flat: Option<Tensor>, tensors: &[Tensor]) -> Tensor {
        let flat = flat.unwrap_or_else(|| Tensor::cat(&tensors.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0));
        for (t, mut view) in tensors.iter().zip(self.views(&flat, tensors)) {
            tch::no_grad(|| view.copy_(t));
            t.shallow_clone().set_data(&view);
        }
        flat
    }

    /// One update of the group from the gradients `grads` (every one defined, of the
    /// parameters' kind and device): they become views of the flat gradient buffer, then the
    /// arithmetic runs once over the buffers.
    pub(super) fn step(&mut self, params: &[Tensor], grads: &[Tensor], h: Hyper, (lr, t): (f64, u64)) {
        // Someone replaced a parameter's or a gradient's storage (a gradient set to None and
        // made anew, say): its current values go back into the flat buffer.
        if !self.aliases(&self.params, params) {
            self.params = self.alias(None, params);
        }
        if !self.grads.as_ref().is_some_and(|g| self.aliases(g, grads)) {
            let old = self.grads.take();
            self.grads = Some(self.alias(old, grads));
        }
        let grad = self.grads.as_ref().expect("made above").shallow_clone();
        update(&mut self.params, grad, (&mut self.exp_avg, &mut self.exp_avg_sq), h, lr, t);
    }
}
