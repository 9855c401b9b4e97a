//! Gradient clipping (`--clip-norm`, `--clip-value`), as Keras's `global_clipnorm`/`clipvalue`
//! and PyTorch's `clip_grad_norm_`/`clip_grad_value_`. It acts on the averaged gradient, after the
//! all-reduce and before the update: every worker holds the same averaged gradient and computes
//! the same norm in the same order, so every worker clips identically, and the run stays bitwise
//! reproducible and resumable.

use serde::Serialize;
use tch::{TchError, Tensor};

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

    /// Clips the gradients of `params` in place: to the global norm first (every gradient times
    /// min(1, norm / (total + 1e-6)), as `torch.nn.utils.clip_grad_norm_` computes it: the 2-norm
    /// of the per-tensor 2-norms), then by value. Returns the global 2-norm before clipping, or
    /// `None` when nothing is clipped or no parameter has a gradient.
    pub fn apply(&self, params: &[(String, Tensor)]) -> Result<Option<f64>, TchError> {
        if self.is_off() {
            return Ok(None);
        }
        let _no_grad = tch::no_grad_guard();
        let mut grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).filter(Tensor::defined).collect();
        if grads.is_empty() {
            return Ok(None);
        }
        // `norm` is libtorch's `linalg_vector_norm` with ord 2 (tch has no binding of the latter).
        let norm = |t: &Tensor| t.f_norm();
        let norms = grads.iter().map(norm).collect::<Result<Vec<_>, _>>()?;
        let total = norm(&Tensor::f_stack(&norms, 0)?)?;
        if let Some(max) = self.norm {
            let coef = (total.f_add_scalar(1e-6)?.f_reciprocal()?.f_mul_scalar(max)?).f_clamp_max(1.0)?;
            for g in &mut grads {
                _ = g.f_mul_(&coef)?;
            }
        }
        if let Some(value) = self.value {
            for g in &mut grads {
                _ = g.f_clamp_(-value, value)?;
            }
        }
        Ok(Some(total.f_double_value(&[])?))
    }
}
