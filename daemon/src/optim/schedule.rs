//! Learning rate as a pure function of the global step, so that a run resumed at step `s`
//! needs nothing but `s` to continue the schedule.
//!
//! The formulas are Hugging Face's (`transformers.optimization`), warmup included: a run's
//! schedule is the same curve as the `get_*_schedule*` function named beside each. Runs started
//! before they were (their position says formulas 1) keep the cosine they started with.

use serde::{Deserialize, Serialize};
use trainerd_sdk::{DecayShape, LrSchedule};

use super::FlagError;

/// The schedule formulas of this version: Hugging Face's, warmup included.
pub(crate) const FORMULAS: u32 = 2;

/// The formulas of commits made before [`FORMULAS`] existed: a cosine that reached its floor at
/// the last step (`step / (total - 1)`), and no warmup.
pub(crate) const FIRST_FORMULAS: u32 = 1;

/// A linear warmup from 0 (from the floor, for `wsd`) to the base rate: a number of steps, or a
/// fraction of the run (Hugging Face's `warmup_steps`, a float below 1 being a ratio).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Warmup {
    /// This many steps.
    Steps(u64),
    /// `ceil(ratio * total steps)` steps.
    Ratio(f64),
}

impl Warmup {
    /// Its steps in a run of `total` steps.
    pub(crate) fn steps(self, total: u64) -> u64 {
        match self {
            Warmup::Steps(n) => n,
            Warmup::Ratio(r) => (total as f64 * r).ceil() as u64,
        }
    }

    /// Parses `--warmup-steps`: N steps, or a fraction F of the run (0 < F < 1).
    pub(crate) fn parse(text: &str) -> Result<Warmup, FlagError> {
        let expected = "a number of steps, or a fraction of the run's steps between 0 and 1 (0.05)";
        let form = || FlagError::Form { flag: "--warmup-steps", text: text.into(), expected };
        if let Ok(n) = text.parse::<u64>() {
            return Ok(Warmup::Steps(n));
        }
        match text.parse::<f64>() {
            Ok(r) if r > 0.0 && r < 1.0 => Ok(Warmup::Ratio(r)),
            _ => Err(form()),
        }
    }
}

/// A run's learning-rate curve: its schedule after its warmup, with the formulas it started with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Curve<'a> {
    pub(crate) schedule: &'a LrSchedule,
    pub(crate) warmup: Option<Warmup>,
    /// [`FORMULAS`], or [`FIRST_FORMULAS`] for a run resumed from a commit made before them.
    pub(crate) formulas: u32,
}

impl Curve<'_> {
    /// The learning rate for `step` (0-based) of a run of `total` steps at base rate `base`.
    pub(crate) fn lr(&self, base: f64, step: u64, total: u64) -> f64 {
        if self.formulas == FIRST_FORMULAS {
            return first_lr(self.schedule, base, step, total);
        }
        base * self.factor(base, step, total)
    }

    /// What the base rate is multiplied by (Hugging Face's `lr_lambda`).
    fn factor(&self, base: f64, step: u64, total: u64) -> f64 {
        let warmup = self.warmup.map_or(0, |w| w.steps(total));
        if let LrSchedule::Wsd { decay, min_lr_ratio, shape } = *self.schedule {
            return wsd(step, (warmup, (total as f64 * decay).round() as u64, total), min_lr_ratio, shape);
        }
        if step < warmup {
            return step as f64 / warmup.max(1) as f64;
        }
        let after = step - warmup;
        let progress = after as f64 / total.saturating_sub(warmup).max(1) as f64;
        match *self.schedule {
            LrSchedule::Constant => 1.0,
            LrSchedule::Step { every, gamma } => gamma.powi((after / every.max(1)) as i32),
            LrSchedule::Exponential { gamma } => gamma.powf(after as f64),
            // get_linear_schedule_with_warmup
            LrSchedule::Linear => (total as f64 - step as f64).max(0.0) / total.saturating_sub(warmup).max(1) as f64,
            // get_cosine_schedule_with_warmup (num_cycles 0.5), and with a floor
            // get_cosine_with_min_lr_schedule_with_warmup (min_lr_rate = min_lr / lr)
            LrSchedule::Cosine { min_lr } => {
                let rate = min_lr / base;
                let factor = 0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * progress).cos());
                (factor * (1.0 - rate) + rate).max(0.0)
            }
            LrSchedule::Wsd { .. } => unreachable!("returned above"),
        }
    }
}

/// get_wsd_schedule(num_warmup_steps, num_decay_steps, num_training_steps, warmup_type="linear",
/// decay_type, min_lr_ratio) at `step`.
fn wsd(step: u64, (warmup, decay, total): (u64, u64, u64), min_ratio: f64, shape: DecayShape) -> f64 {
    let (step, warmup, decay) = (step as i128, warmup as i128, decay as i128);
    let stable = total as i128 - warmup - decay;
    let floor = |factor: f64| (factor * (1.0 - min_ratio) + min_ratio).max(0.0);
    if step < warmup {
        return floor(step as f64 / warmup.max(1) as f64);
    }
    if step < warmup + stable {
        return 1.0;
    }
    if step < warmup + stable + decay {
        let progress = (step - warmup - stable) as f64 / decay.max(1) as f64;
        return floor(match shape {
            DecayShape::Linear => 1.0 - progress,
            DecayShape::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * 0.5 * 2.0 * progress).cos()),
            DecayShape::Sqrt => 1.0 - progress.sqrt(),
        });
    }
    min_ratio
}

/// The learning rate of formulas 1 (commits made before Hugging Face's), to the bit: no warmup,
/// and a cosine that reaches its floor at the last step.
fn first_lr(schedule: &LrSchedule, base: f64, step: u64, total: u64) -> f64 {
    match *schedule {
        LrSchedule::Cosine { min_lr } => {
            let progress = if total <= 1 { 0.0 } else { step.min(total - 1) as f64 / (total - 1) as f64 };
            min_lr + (base - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
        _ => base * Curve { schedule, warmup: None, formulas: FORMULAS }.factor(base, step, total),
    }
}

/// Parses the `--lr-schedule` flag: `constant`, `linear`, `cosine[:MIN_LR]`,
/// `wsd:DECAY[:MIN_LR_RATIO[:SHAPE]]`, `step:EVERY:GAMMA` or `exp:GAMMA`.
pub(crate) fn parse(text: &str) -> Result<LrSchedule, FlagError> {
    const FLAG: &str = "--lr-schedule";
    let parts: Vec<&str> = text.split(':').collect();
    let part = |part: &'static str, value: &str, what: &'static str| FlagError::Part {
        flag: FLAG,
        text: text.into(),
        part,
        value: value.into(),
        what,
    };
    let num = |s: &str, name: &'static str| s.parse::<f64>().map_err(|_| part(name, s, "a number"));
    let fraction = |s: &str, name: &'static str| {
        s.parse::<f64>().ok().filter(|f| (0.0..=1.0).contains(f)).ok_or_else(|| part(name, s, "a fraction from 0 to 1"))
    };
    let shape = |s: &str| match s {
        "cosine" => Ok(DecayShape::Cosine),
        "linear" => Ok(DecayShape::Linear),
        "1-sqrt" | "sqrt" => Ok(DecayShape::Sqrt),
        _ => Err(part("SHAPE", s, "cosine, linear or 1-sqrt")),
    };
    let wsd = |decay: &str, min: Option<&str>, s: Option<&str>| -> Result<LrSchedule, FlagError> {
        Ok(LrSchedule::Wsd {
            decay: fraction(decay, "DECAY")?,
            min_lr_ratio: min.map_or(Ok(0.0), |m| fraction(m, "MIN_LR_RATIO"))?,
            shape: s.map_or(Ok(DecayShape::Cosine), shape)?,
        })
    };
    match parts.as_slice() {
        ["constant"] => Ok(LrSchedule::Constant),
        ["linear"] => Ok(LrSchedule::Linear),
        ["cosine"] => Ok(LrSchedule::Cosine { min_lr: 0.0 }),
        ["cosine", min] => Ok(LrSchedule::Cosine { min_lr: num(min, "MIN_LR")? }),
        ["wsd", decay] => wsd(decay, None, None),
        ["wsd", decay, min] => wsd(decay, Some(min), None),
        ["wsd", decay, min, s] => wsd(decay, Some(min), Some(s)),
        ["exp", gamma] => Ok(LrSchedule::Exponential { gamma: num(gamma, "GAMMA")? }),
        ["step", every, gamma] => Ok(LrSchedule::Step {
            every: every
                .parse::<u64>()
                .ok()
                .filter(|&e| e > 0)
                .ok_or_else(|| part("EVERY", every, "a positive integer"))?,
            gamma: num(gamma, "GAMMA")?,
        }),
        _ => Err(FlagError::Form { flag: FLAG, text: text.into(), expected: EXPECTED }),
    }
}

/// The forms `--lr-schedule` takes.
const EXPECTED: &str =
    "constant, linear, cosine[:MIN_LR], wsd:DECAY[:MIN_LR_RATIO[:cosine|linear|1-sqrt]], step:EVERY:GAMMA or exp:GAMMA";

#[cfg(test)]
mod tests;
