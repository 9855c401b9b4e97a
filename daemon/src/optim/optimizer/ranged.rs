//! An update run a range of elements at a time, as a returner's replay takes a step's gradient
//! in piece by piece and bucket by bucket (docs/fault-tolerance.md, "By piece" and "By bucket"):
//! every rule is element-wise, so each range's update is the whole's, the same bits.

use tch::Tensor;
use trainerd_sdk::{KerasOptimizer, OptimizerConfig};

use super::{per_parameter, Optimizer, RangedRules, Slots};
use crate::optim::elementwise::{self, Rule};

impl Optimizer {
    /// The next update at rate `lr` made ready to run a range of elements at a time, as a
    /// returner's replay takes a step's gradient in ([`Optimizer::update_range`]): every rule is
    /// element-wise, so each range's update is the whole's, the same bits. `None`, and nothing
    /// changed, where a rule needs the whole gradient (Keras's `clipnorm`) or a tensor is not plain
    /// float32 on the CPU: [`Optimizer::step`] then runs once the gradient is whole.
    pub(crate) fn ranged(&mut self, params: &[(String, Tensor)], with_grad: &[bool], lr: f64) -> Option<RangedRules> {
        if !self.rangeable(params, with_grad) {
            return None;
        }
        self.steps += 1;
        Some(self.more_ranged(params, with_grad, lr))
    }

    /// Whether the update of the parameters `which` can run a range at a time
    /// ([`Optimizer::ranged`]): no rule needs the whole gradient, and each of them and its state
    /// is plain float32 on the CPU.
    pub(crate) fn rangeable(&self, params: &[(String, Tensor)], which: &[bool]) -> bool {
        if let OptimizerConfig::Keras(KerasOptimizer { clipnorm: Some(_), .. }) = self.config {
            return false;
        }
        let plain = |t: &Tensor, n: usize| elementwise::plain(t) && t.numel() == n;
        // (SGD's momentum buffer not made yet is no tensor here.)
        let of = |i: usize, p: &Tensor| {
            plain(p, p.numel()) && self.slots[i].named().iter().all(|(_, t)| plain(t, p.numel()))
        };
        params.iter().enumerate().filter(|&(i, _)| which[i]).all(|(i, (_, p))| of(i, p))
    }

    /// The rules of the parameters `with_grad` in the update [`Optimizer::ranged`] made ready (the
    /// step counted there, once): for a returner whose step's gradients come in several items
    /// (docs/fault-tolerance.md, "By bucket"), each item's parameters as it comes. The caller
    /// checked them ([`Optimizer::rangeable`]).
    pub(crate) fn more_ranged(&mut self, params: &[(String, Tensor)], with_grad: &[bool], lr: f64) -> RangedRules {
        let _no_grad = tch::no_grad_guard();
        let decay = per_parameter(&self.groups, params.len());
        let rules = params.iter().enumerate().map(|(i, (_, p))| {
            with_grad[i].then(|| {
                let first = matches!(self.slots[i], Slots::Sgd { momentum_buffer: None });
                let r = self.rule(decay[i], lr);
                if let (true, Slots::Sgd { momentum_buffer }) = (first && r.state_len() == 1, &mut self.slots[i]) {
                    *momentum_buffer = Some(p.zeros_like());
                }
                (r, first)
            })
        });
        rules.collect()
    }

    /// Elements `range` of parameter `i` (`p`) updated from its gradient `grad` by `(rule, first)`
    /// of [`Optimizer::ranged`].
    pub(crate) fn update_range(
        &mut self,
        i: usize,
        (rule, first): (Rule, bool),
        (p, grad): (&Tensor, &Tensor),
        range: std::ops::Range<usize>,
    ) {
        let state: Vec<&Tensor> = self.slots[i].named().into_iter().map(|(_, t)| t).collect();
        let n = p.numel();
        assert!(range.end <= n && grad.numel() == n && state.len() == rule.state_len(), "checked by ranged");
        let slice = |t: &Tensor| {
            // SAFETY: contiguous float32 CPU tensors of `n` elements each ([`Optimizer::ranged`]
            // checked them), distinct (a parameter, its gradient and its own state tensors), and
            // `range` within them; the slices live only in this call.
            unsafe { std::slice::from_raw_parts_mut((t.data_ptr() as *mut f32).add(range.start), range.len()) }
        };
        let (p, g) = (slice(p), slice(grad));
        let mut state: Vec<&mut [f32]> = state.into_iter().map(slice).collect();
        rule.apply(p, g, &mut state, first, crate::optim::lanes::Write::Both);
    }
}
