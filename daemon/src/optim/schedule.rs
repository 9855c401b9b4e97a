//! Learning rate as a pure function of the global step, so that a run resumed at step `s`
//! needs nothing but `s` to continue the schedule.

use trainerd_sdk::LrSchedule;

use super::FlagError;

/// The learning rate for `step` (0-based) of a run of `total_steps` steps.
pub(crate) fn lr_at(schedule: &LrSchedule, base: f64, step: u64, total_steps: u64) -> f64 {
    match *schedule {
        LrSchedule::Constant => base,
        LrSchedule::Step { every, gamma } => base * gamma.powi((step / every.max(1)) as i32),
        LrSchedule::Exponential { gamma } => base * gamma.powf(step as f64),
        LrSchedule::Cosine { min_lr } => {
            let progress =
                if total_steps <= 1 { 0.0 } else { step.min(total_steps - 1) as f64 / (total_steps - 1) as f64 };
            min_lr + (base - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

/// Parses the `--lr-schedule` flag: `constant`, `cosine[:MIN_LR]`, `step:EVERY:GAMMA` or
/// `exp:GAMMA`.
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
    match parts.as_slice() {
        ["constant"] => Ok(LrSchedule::Constant),
        ["cosine"] => Ok(LrSchedule::Cosine { min_lr: 0.0 }),
        ["cosine", min] => Ok(LrSchedule::Cosine { min_lr: num(min, "MIN_LR")? }),
        ["exp", gamma] => Ok(LrSchedule::Exponential { gamma: num(gamma, "GAMMA")? }),
        ["step", every, gamma] => Ok(LrSchedule::Step {
            every: every
                .parse::<u64>()
                .ok()
                .filter(|&e| e > 0)
                .ok_or_else(|| part("EVERY", every, "a positive integer"))?,
            gamma: num(gamma, "GAMMA")?,
        }),
        _ => Err(FlagError::Form {
            flag: FLAG,
            text: text.into(),
            expected: "constant, cosine[:MIN_LR], step:EVERY:GAMMA or exp:GAMMA",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        assert_eq!(lr_at(&LrSchedule::Constant, 0.1, 99, 100), 0.1);
        let step = LrSchedule::Step { every: 10, gamma: 0.5 };
        assert_eq!(lr_at(&step, 0.1, 9, 100), 0.1);
        assert_eq!(lr_at(&step, 0.1, 20, 100), 0.025);
        let cos = LrSchedule::Cosine { min_lr: 0.0 };
        assert_eq!(lr_at(&cos, 0.1, 0, 11), 0.1);
        assert!((lr_at(&cos, 0.1, 5, 11) - 0.05).abs() < 1e-12);
        assert!(lr_at(&cos, 0.1, 10, 11).abs() < 1e-12);
        assert!((lr_at(&LrSchedule::Exponential { gamma: 0.9 }, 1.0, 2, 5) - 0.81).abs() < 1e-12);
    }

    #[test]
    fn parse_flags() {
        assert_eq!(parse("step:100:0.5"), Ok(LrSchedule::Step { every: 100, gamma: 0.5 }));
        assert_eq!(parse("cosine"), Ok(LrSchedule::Cosine { min_lr: 0.0 }));
        assert_eq!(
            parse("step:0:0.5").unwrap_err().to_string(),
            "--lr-schedule step:0:0.5: EVERY \"0\" is not a positive integer"
        );
        assert_eq!(
            parse("linear").unwrap_err().to_string(),
            "--lr-schedule linear: expected constant, cosine[:MIN_LR], step:EVERY:GAMMA or exp:GAMMA"
        );
    }
}
