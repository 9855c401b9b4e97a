//! Adam's and AdamW's arithmetic: the update of one tensor (PyTorch's rules; float32 on the CPU
//! in one pass over memory, [`elementwise`]), and the flat buffers that let one update cover a whole group
//! of parameters.

use tch::Tensor;

use super::elementwise::{self, Rule};

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

    /// The element-wise rule of an update at rate `lr` at step `t` (1-based): the float32
    /// arithmetic of libtorch's kernels, in one pass over memory (libtorch's kernels make about
    /// twenty, and on a CPU the update is bound by memory, not arithmetic).
    pub(super) fn rule(&self, lr: f64, t: u64) -> Rule {
        let t = t as i32;
        let (bias1, bias2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        let shrink = self.shrink(lr);
        Rule::Adam {
            shrink: (shrink != 1.0).then_some(shrink as f32),
            wd: self.l2() as f32,
            betas: [self.beta1 as f32, (1.0 - self.beta1) as f32, self.beta2 as f32, (1.0 - self.beta2) as f32],
            eps: self.eps as f32,
            step_size: (-lr / bias1) as f32,
            bias2_sqrt: bias2.sqrt() as f32,
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
    if elementwise::on_tensors(&h.rule(lr, t), p, &grad, &mut [exp_avg, exp_avg_sq], false) {
        return;
    }
    let t = t as i32;
    let bias1 = 1.0 - h.beta1.powi(t);
    let bias2 = 1.0 - h.beta2.powi(t);
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
    /// On the CPU: the gradients were made views of another buffer after they were this one's
    /// (the gradient buckets', whose last slot's gradients are views of its buffers): they are
    /// left there, and the update goes parameter by parameter ([`FlatAdam::takes`]).
    elsewhere: bool,
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
        let (exp_avg, exp_avg_sq, none) = (zeros(), zeros(), Tensor::new());
        let mut flat = FlatAdam { exp_avg, exp_avg_sq, params: none, grads: None, numels, elsewhere: false };
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

    /// Whether this step's update runs over the flat buffers with `grads` made views of the flat
    /// gradient buffer. Not on the CPU once the gradients it had were made views of another
    /// buffer: taking them back every step would copy every gradient twice a step and hold two
    /// of each (the buckets' and this one's); the update parameter by parameter reads them where
    /// they lie, with the same arithmetic (the same bits), and this buffer is let go.
    pub(super) fn takes(&mut self, grads: &[Tensor]) -> bool {
        if self.elsewhere {
            return false;
        }
        let moved = self.grads.as_ref().is_some_and(|g| g.device() == tch::Device::Cpu && !self.aliases(g, grads));
        if moved {
            self.leave_grads();
        }
        !moved
    }

    /// The gradients are another buffer's views (the buckets' in-place staging): the update
    /// leaves them there from now on ([`FlatAdam::takes`]).
    pub(super) fn leave_grads(&mut self) {
        self.elsewhere = true;
        self.grads = None;
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
