//! Gradient clipping (`--clip-norm`, `--clip-value`), as Keras's `global_clipnorm`/`clipvalue`
//! and PyTorch's `clip_grad_norm_`/`clip_grad_value_`, the global norm taken over the gradient
//! buckets' ranges in a fixed order (so the sharded step clips alike). It acts on the averaged gradient, after the
//! all-reduce and before the update: every worker holds the same averaged gradient and computes
//! the same norm in the same order, so every worker clips identically, and the run stays bitwise
//! reproducible and resumable.

use std::ops::Range;

use serde::Serialize;
use tch::{TchError, Tensor};

use super::sharded_state::Piece;
use super::FlagError;

/// What to clip; nothing when both are `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Clip {
    /// The largest global 2-norm of the gradients (over every parameter together).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm: Option<f64>,
    /// Every gradient element is clamped to [-value, value].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
}

impl Clip {
    /// True when it clips nothing.
    pub(crate) fn is_off(&self) -> bool {
        self.norm.is_none() && self.value.is_none()
    }

    /// A flag's value: a positive, finite number.
    pub(crate) fn parse(flag: &'static str, text: &str) -> Result<f64, FlagError> {
        match text.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(FlagError::Form { flag, text: text.into(), expected: "a positive number" }),
        }
    }

    /// Clips the gradients of `params` in place, each parameter a range of its own: as
    /// [`Clip::apply_over`].
    pub fn apply(&self, params: &[(String, Tensor)]) -> Result<Option<f64>, TchError> {
        let ranges: Vec<Vec<Piece>> = params
            .iter()
            .enumerate()
            .map(|(i, (_, p))| vec![Piece { param: i, offset: 0, at: 0, len: p.numel() }])
            .collect();
        self.apply_over(params, &ranges)
    }

    /// Clips the gradients of `params` in place: to the global norm first (every gradient times
    /// min(1, norm / (total + 1e-6)), as `torch.nn.utils.clip_grad_norm_` computes it), then by
    /// value. The global norm is taken over `ranges` ([`Clip::norm_over`]), so sharded and
    /// unsharded runs clip alike. Returns the global 2-norm before clipping, or `None` when
    /// nothing is clipped or no parameter has a gradient.
    pub(crate) fn apply_over(
        &self,
        params: &[(String, Tensor)],
        ranges: &[Vec<Piece>],
    ) -> Result<Option<f64>, TchError> {
        let total = self.norm_over(params, ranges)?;
        if let Some(total) = total {
            self.apply_at(params, total)?;
        }
        Ok(total)
    }

    /// The global 2-norm of the gradients of `params` before clipping, over `ranges` (the
    /// gradient buckets' ranges, which the sharded step clips by: [`range_sum_of_squares`] per
    /// range, added in order, as [`global_norm`]); `None` when nothing is clipped or no parameter
    /// has a gradient.
    pub(crate) fn norm_over(
        &self,
        params: &[(String, Tensor)],
        ranges: &[Vec<Piece>],
    ) -> Result<Option<f64>, TchError> {
        if self.is_off() {
            return Ok(None);
        }
        let _no_grad = tch::no_grad_guard();
        let grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).collect();
        if !grads.iter().any(Tensor::defined) {
            return Ok(None);
        }
        let mut partials = Vec::with_capacity(ranges.len());
        // Off the host (CUDA), the sums are taken on the device and fetched at once.
        let mut on_device = Vec::new();
        for range in ranges {
            let mut host = Vec::new();
            for piece in range.iter().filter(|p| grads[p.param].defined()) {
                let g = &grads[piece.param];
                match super::elementwise::host_f32(g) {
                    Some(all) => host.push(&all[piece.offset..piece.offset + piece.len]),
                    None => on_device.push((
                        partials.len(),
                        g.f_view(-1)?
                            .f_narrow(0, piece.offset as i64, piece.len as i64)?
                            .f_to_kind(tch::Kind::Double)?
                            .f_square()?
                            .f_sum(tch::Kind::Double)?,
                    )),
                }
            }
            partials.push(range_sum_of_squares(&host));
        }
        if !on_device.is_empty() {
            let sums = Tensor::f_stack(&on_device.iter().map(|(_, t)| t.shallow_clone()).collect::<Vec<_>>(), 0)?;
            let sums = Vec::<f64>::try_from(sums.f_to_device(tch::Device::Cpu)?)?;
            for ((r, _), s) in on_device.iter().zip(sums) {
                partials[*r] += s;
            }
        }
        Ok(Some(global_norm(&partials)))
    }

    /// Clips the gradients of `params` in place at global norm `total` ([`Clip::norm_over`]'s).
    pub(crate) fn apply_at(&self, params: &[(String, Tensor)], total: f64) -> Result<(), TchError> {
        let _no_grad = tch::no_grad_guard();
        for (_, p) in params {
            self.clip_elements(&p.grad(), None, total)?;
        }
        Ok(())
    }

    /// Clips gradient `g` in place at global norm `total`, its elements `elements` alone (of it
    /// flattened) or all of them: each element's arithmetic as every other's, so clipping a
    /// gradient range by range as it arrives gives the bits of clipping it whole. An undefined
    /// gradient is left as it is.
    pub(crate) fn clip_elements(&self, g: &Tensor, elements: Option<Range<usize>>, total: f64) -> Result<(), TchError> {
        if !g.defined() {
            return Ok(());
        }
        let _no_grad = tch::no_grad_guard();
        let mut g = match elements {
            Some(r) => g.f_view(-1)?.f_narrow(0, r.start as i64, r.len() as i64)?,
            None => g.shallow_clone(),
        };
        if let Some(c) = self.coefficient(total) {
            _ = g.f_mul_scalar_(f64::from(c))?;
        }
        if let Some(value) = self.value {
            _ = g.f_clamp_(-value, value)?;
        }
        Ok(())
    }

    /// What the gradients are multiplied by at global norm `total`: min(1, norm / (total +
    /// 1e-6)) as float32; `None` when nothing is (no `--clip-norm`, or a factor of 1).
    pub(crate) fn coefficient(&self, total: f64) -> Option<f32> {
        let max = self.norm?;
        let c = (max / (total + 1e-6)).min(1.0) as f32;
        (c != 1.0).then_some(c)
    }

    /// Clips one range's gradient elements (host float32) with the step's `coefficient`, then
    /// by value: each element's arithmetic as [`Clip::apply_over`]'s.
    pub(crate) fn clip_slice(&self, xs: &mut [f32], coefficient: Option<f32>) {
        if let Some(c) = coefficient {
            xs.iter_mut().for_each(|x| *x *= c);
        }
        if let Some(value) = self.value {
            let (lo, hi) = (-value as f32, value as f32);
            xs.iter_mut().for_each(|x| *x = x.clamp(lo, hi));
        }
    }
}

/// The sum of the squares of `xs`, in float64, in element order: a range's share of the
/// global norm, the same wherever it is computed.
pub(crate) fn sum_of_squares(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

/// The global 2-norm from every range's sum of squares, added in the ranges' order.
pub(crate) fn global_norm(partials: &[f64]) -> f64 {
    partials.iter().sum::<f64>().sqrt()
}

/// A range's sum of squares from its pieces' gradients: [`sum_of_squares`] of each, added in
/// order.
pub(crate) fn range_sum_of_squares(pieces: &[&[f32]]) -> f64 {
    let mut sum = 0.0;
    for piece in pieces {
        sum += sum_of_squares(piece);
    }
    sum
}
