//! Mixed precision (`--precision fp32|bf16|fp16`), as PyTorch's autocast and Keras's
//! `mixed_bfloat16`/`mixed_float16` policies: the forward pass and the loss run under libtorch's
//! autocast (matrix products and convolutions in the low precision, reductions and the loss in
//! float32), while parameters, gradients, optimizer state and checkpoints stay float32.
//!
//! tch binds autocast only for CUDA and without a dtype, so a small C++ shim
//! (`csrc/autocast.cpp`, compiled against the libtorch tch links) switches it for the CPU too.
//! Autocast is thread-local: [`Autocast`] enters it on the computing thread and leaves it on drop.

use std::ffi::{c_char, c_int};

use super::FlagError;
use crate::sys::shim::status as check;

use tch::Device;

unsafe extern "C" {
    fn trainerd_autocast_enter(cuda: c_int, half: c_int, was_enabled: *mut c_int, was_dtype: *mut c_int)
        -> *mut c_char;
    fn trainerd_autocast_exit(cuda: c_int, was_enabled: c_int, was_dtype: c_int) -> *mut c_char;
    #[cfg(test)]
    fn trainerd_autocast_enabled(cuda: c_int) -> c_int;
}

/// The precision of the forward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Precision {
    /// Float32 throughout.
    #[default]
    Fp32,
    /// Autocast to bfloat16 (CPU and CUDA).
    Bf16,
    /// Autocast to float16 with dynamic loss scaling (CUDA only).
    Fp16,
}

impl std::str::FromStr for Precision {
    type Err = FlagError;

    fn from_str(s: &str) -> Result<Precision, FlagError> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            other => Err(FlagError::Form { flag: "--precision", text: other.into(), expected: "fp32, bf16 or fp16" }),
        }
    }
}

impl Precision {
    /// Its name, as the flag takes it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// Whether it can train on `device`: float16 (with loss scaling) is for GPUs.
    pub(crate) fn check(self, device: Device) -> Result<(), FlagError> {
        if self == Precision::Fp16 && !device.is_cuda() {
            return Err(FlagError::Fp16OnCpu);
        }
        Ok(())
    }

    /// What the run configuration says of it (nothing for float32, so that a run configuration
    /// stays what it was before precisions).
    pub(crate) fn agreement(self) -> Option<&'static str> {
        (self != Precision::Fp32).then_some(self.name())
    }

    /// Autocast for `device` until the guard drops (none for float32).
    pub(crate) fn autocast(self, device: Device) -> Result<Option<Autocast>, tch::TchError> {
        if self == Precision::Fp32 {
            return Ok(None);
        }
        let cuda = c_int::from(device.is_cuda());
        let (mut was_enabled, mut was_dtype) = (0, 0);
        // SAFETY: the shim's function, with plain integers and valid out pointers.
        check(unsafe {
            trainerd_autocast_enter(cuda, c_int::from(self == Precision::Fp16), &mut was_enabled, &mut was_dtype)
        })?;
        Ok(Some(Autocast { cuda, was: (was_enabled, was_dtype) }))
    }
}

/// An autocast region on this thread; left on drop, the settings it replaced put back.
#[derive(Debug)]
pub(crate) struct Autocast {
    cuda: c_int,
    /// Whether autocast was on, and its dtype (libtorch's ScalarType), before the region.
    was: (c_int, c_int),
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // SAFETY: the shim's function; the region was entered by `Precision::autocast`.
        if let Err(e) = check(unsafe { trainerd_autocast_exit(self.cuda, self.was.0, self.was.1) }) {
            tracing::warn!("leaving autocast: {e}");
        }
    }
}

/// Dynamic loss scaling for float16, as PyTorch's `GradScaler` with its defaults: the loss is
/// multiplied by the scale before backward, so that small gradients survive float16; the averaged
/// gradient is divided by it before the update. A step whose averaged gradient is not finite is
/// skipped (no update, the optimizer's step count unchanged) and halves the scale; 2,000 finite
/// steps in a row double it. The data and the learning-rate schedule move on over a skipped step,
/// as a PyTorch loop's do. Decided on the all-reduced gradient, so every worker skips the same
/// steps; part of the training state, so a resumed run scales as the uninterrupted one.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LossScale {
    /// The scale.
    pub(crate) scale: f64,
    /// Finite steps since the scale last changed.
    pub(crate) good_steps: u32,
    /// Steps skipped so far.
    pub(crate) skipped: u64,
}

impl Default for LossScale {
    fn default() -> LossScale {
        LossScale { scale: 65536.0, good_steps: 0, skipped: 0 }
    }
}

impl LossScale {
    /// Finite steps before the scale doubles.
    pub(crate) const GROWTH_INTERVAL: u32 = 2000;

    /// Takes a step whose averaged gradient was `finite` or not; whether to apply the update.
    pub(crate) fn update(&mut self, finite: bool) -> bool {
        if !finite {
            (self.scale, self.good_steps, self.skipped) = (self.scale * 0.5, 0, self.skipped + 1);
            return false;
        }
        self.good_steps += 1;
        if self.good_steps == Self::GROWTH_INTERVAL {
            (self.scale, self.good_steps) = (self.scale * 2.0, 0);
        }
        true
    }
}

/// Divides the gradients of `params` by `scale` (as a float32 reciprocal, as PyTorch's
/// unscaling does); whether every one of them is finite (if not, they are left as they were).
pub(crate) fn unscale(params: &[(String, tch::Tensor)], scale: f64) -> Result<bool, tch::TchError> {
    let _no_grad = tch::no_grad_guard();
    let grads: Vec<tch::Tensor> = params.iter().map(|(_, p)| p.grad()).filter(|g| g.defined()).collect();
    let mut finite = true;
    for g in &grads {
        finite &= g.f_isfinite()?.f_all()?.f_int64_value(&[])? != 0;
    }
    if finite {
        let inverse = f64::from((1.0 / scale) as f32);
        for g in &grads {
            let _ = g.shallow_clone().f_mul_scalar_(inverse)?;
        }
    }
    Ok(finite)
}

/// Whether autocast is on for `device` on this thread (what the tests check).
#[cfg(test)]
fn autocast_enabled(device: Device) -> bool {
    // SAFETY: the shim's function, with a plain integer.
    unsafe { trainerd_autocast_enabled(c_int::from(device.is_cuda())) != 0 }
}

impl Precision {
    /// The run's start-up line about it; `None` for float32.
    pub(crate) fn start_line(self) -> Option<&'static str> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(
                "trainerd: mixed precision: the forward pass under autocast to bfloat16; parameters, optimizer state \
                 and checkpoints float32",
            ),
            Precision::Fp16 => Some(
                "trainerd: mixed precision: the forward pass under autocast to float16 with dynamic loss scaling; \
                 parameters, optimizer state and checkpoints float32",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn bf16_autocast_runs_a_matrix_product_in_bfloat16_on_the_cpu_and_only_inside_the_region() {
        let (a, b) =
            (Tensor::ones([4, 4], (Kind::Float, Device::Cpu)), Tensor::ones([4, 4], (Kind::Float, Device::Cpu)));
        {
            let _region = Precision::Bf16.autocast(Device::Cpu).unwrap();
            assert!(autocast_enabled(Device::Cpu));
            assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
            assert_eq!(a.sum(Kind::Float).kind(), Kind::Float, "reductions stay float32");
        }
        assert!(!autocast_enabled(Device::Cpu));
        assert_eq!(a.matmul(&b).kind(), Kind::Float);
        // Nested regions put back what they replaced.
        {
            let _outer = Precision::Bf16.autocast(Device::Cpu).unwrap();
            drop(Precision::Bf16.autocast(Device::Cpu).unwrap());
            assert!(autocast_enabled(Device::Cpu), "the outer region is still on");
            assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
        }
        assert!(!autocast_enabled(Device::Cpu));
        assert!(Precision::Fp32.autocast(Device::Cpu).unwrap().is_none());
    }

    #[test]
    fn the_loss_scale_halves_on_overflow_and_doubles_after_2000_finite_steps() {
        let mut s = LossScale::default();
        assert!(!s.update(false));
        assert_eq!((s.scale, s.skipped), (32768.0, 1));
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            assert!(s.update(true));
        }
        assert_eq!(s.scale, 32768.0);
        assert!(s.update(true));
        assert_eq!((s.scale, s.good_steps, s.skipped), (65536.0, 0, 1));
    }

    #[test]
    fn unscaling_divides_finite_gradients_and_leaves_an_overflow_alone() {
        let p = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&p * Tensor::from_slice(&[1024.0f32, 2048.0, -512.0])).sum(Kind::Float).backward();
        let params = vec![("p".to_string(), p)];
        assert!(unscale(&params, 1024.0).unwrap());
        assert_eq!(Vec::<f32>::try_from(params[0].1.grad()).unwrap(), [1.0, 2.0, -0.5]);
        let _ = params[0].1.grad().shallow_clone().fill_(f64::INFINITY);
        assert!(!unscale(&params, 2.0).unwrap());
        assert!(Vec::<f32>::try_from(params[0].1.grad()).unwrap().iter().all(|g| g.is_infinite()));
    }

    #[test]
    fn the_flag_names_what_it_takes() {
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!(
            "half".parse::<Precision>().unwrap_err().to_string(),
            "--precision half: expected fp32, bf16 or fp16"
        );
        assert!(Precision::Fp16.check(Device::Cpu).unwrap_err().to_string().starts_with("--precision fp16 needs CUDA"));
        assert!(Precision::Bf16.check(Device::Cpu).is_ok());
        assert_eq!((Precision::Fp32.agreement(), Precision::Bf16.agreement()), (None, Some("bf16")));
    }
}
