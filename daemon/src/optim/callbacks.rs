//! Callbacks as flags, as Keras's: `--early-stopping METRIC:PATIENCE[:MIN_DELTA]`
//! (`EarlyStopping`) and `--reduce-lr-on-plateau METRIC:FACTOR:PATIENCE` (`ReduceLROnPlateau`).
//! Each watches one epoch-end figure: `val_loss` or `val_NAME` (the evaluation on the test split),
//! `loss` or `NAME` (the epoch's training means). A name with `loss` or `error` in it is minimised,
//! any other maximised, as Keras's `mode="auto"` does. What they remember is part of the training state (the
//! position, [`CallbackState`]), and every worker sees the same figures, so they act at the same
//! epoch on every worker, and after a kill and a resume exactly as without one.

use serde::{Deserialize, Serialize};

use super::FlagError;

/// Keras's `ReduceLROnPlateau` default `min_delta`: a smaller change is no improvement.
const PLATEAU_MIN_DELTA: f64 = 1e-4;

/// One epoch-end figure watched for improvement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Watch {
    /// `val_loss`, `val_NAME`, `loss` or `NAME`.
    pub(crate) metric: String,
    /// Epochs without improvement before acting.
    pub(crate) patience: u32,
    /// The smallest change that counts as an improvement.
    pub(crate) min_delta: f64,
}

/// The callbacks of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub(crate) struct Callbacks {
    /// Stop once the figure has not improved for `patience` epochs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) early_stopping: Option<Watch>,
    /// Multiply the learning rate by the factor once the figure has not improved for `patience`
    /// epochs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reduce_lr_on_plateau: Option<(Watch, f64)>,
}

/// What the callbacks remember between epochs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct CallbackState {
    /// Early stopping's best figure and epochs since.
    pub(crate) early: Watched,
    /// The plateau's best figure and epochs since.
    pub(crate) plateau: Watched,
    /// The product of the plateau's reductions so far (1 when none; absent in the state then).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(crate) lr_scale: f64,
    /// Early stopping ended the run after this epoch (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) stopped_after: Option<u32>,
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

impl Default for CallbackState {
    fn default() -> CallbackState {
        CallbackState { early: Watched::default(), plateau: Watched::default(), lr_scale: 1.0, stopped_after: None }
    }
}

impl CallbackState {
    /// True when no callback has anything to remember (a run without callbacks): the state then
    /// encodes as it always did.
    pub(crate) fn is_unused(&self) -> bool {
        *self == CallbackState::default()
    }
}

/// A figure's best value and the epochs since it was reached.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Watched {
    /// The best value so far (none before the first epoch's end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) best: Option<f64>,
    /// Epochs since it improved.
    #[serde(default)]
    pub(crate) wait: u32,
}

impl Watched {
    /// Takes an epoch's `value` of `metric`: an improvement (by more than `min_delta`, in the
    /// metric's direction) becomes the best and resets the wait, anything else adds an epoch to
    /// it. True when it improved.
    pub(crate) fn observe(&mut self, metric: &str, value: f64, min_delta: f64) -> bool {
        let improved = match self.best {
            None => true,
            Some(best) if minimised(metric) => value < best - min_delta,
            Some(best) => value > best + min_delta,
        };
        if improved {
            (self.best, self.wait) = (Some(value), 0);
        } else {
            self.wait += 1;
        }
        improved
    }
}

/// What the callbacks did at an epoch's end, to be told.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Acted {
    /// Early stopping ends the run now.
    pub(crate) stop: Option<String>,
    /// The learning rate was multiplied.
    pub(crate) reduced: Option<String>,
}

impl Callbacks {
    /// True when there are none.
    pub(crate) fn is_empty(&self) -> bool {
        self.early_stopping.is_none() && self.reduce_lr_on_plateau.is_none()
    }

    /// The epoch `epoch` (1-based) ended with `figures` (name, value): updates `state`.
    pub(crate) fn epoch_end(&self, epoch: u32, figures: &[(String, f64)], state: &mut CallbackState) -> Acted {
        let value = |metric: &str| figures.iter().find(|(n, _)| n == metric).map(|&(_, v)| v);
        let mut acted = Acted::default();
        if let Some((w, factor)) = &self.reduce_lr_on_plateau {
            if let Some(v) = value(&w.metric) {
                if !state.plateau.observe(&w.metric, v, w.min_delta) && state.plateau.wait >= w.patience {
                    state.plateau.wait = 0;
                    state.lr_scale *= factor;
                    acted.reduced = Some(format!(
                        "{} has not improved for {} epoch(s) (best {:.4}): learning rate x{factor} (x{} in all)",
                        w.metric,
                        w.patience,
                        state.plateau.best.unwrap_or(v),
                        state.lr_scale
                    ));
                }
            }
        }
        if let Some(w) = &self.early_stopping {
            if let Some(v) = value(&w.metric) {
                if !state.early.observe(&w.metric, v, w.min_delta) && state.early.wait >= w.patience {
                    state.stopped_after = Some(epoch);
                    acted.stop = Some(format!(
                        "{} has not improved by more than {} for {} epoch(s) (best {:.4}): stopping after epoch {epoch}",
                        w.metric,
                        w.min_delta,
                        w.patience,
                        state.early.best.unwrap_or(v)
                    ));
                }
            }
        }
        acted
    }
}

/// `METRIC:PATIENCE[:MIN_DELTA]` of `--early-stopping`, its METRIC one of `names`.
pub(crate) fn parse_early_stopping(text: &str, names: &[String]) -> Result<Watch, FlagError> {
    let flag = "--early-stopping";
    let parts: Vec<&str> = text.split(':').collect();
    let expected = || FlagError::Form {
        flag,
        text: text.into(),
        expected: "METRIC:PATIENCE[:MIN_DELTA], such as val_loss:3 or val_accuracy:2:0.001",
    };
    let (metric, patience, min_delta) = match parts[..] {
        [m, p] => (m, p, "0"),
        [m, p, d] => (m, p, d),
        _ => return Err(expected()),
    };
    let patience = patience.parse::<u32>().ok().filter(|&p| p > 0).ok_or_else(expected)?;
    let min_delta = min_delta.parse::<f64>().ok().filter(|d| d.is_finite() && *d >= 0.0).ok_or_else(expected)?;
    Ok(Watch { metric: known(flag, text, metric, names)?, patience, min_delta })
}

/// `METRIC:FACTOR:PATIENCE` of `--reduce-lr-on-plateau`, its METRIC one of `names`.
pub(crate) fn parse_reduce_lr(text: &str, names: &[String]) -> Result<(Watch, f64), FlagError> {
    let flag = "--reduce-lr-on-plateau";
    let expected = || FlagError::Form {
        flag,
        text: text.into(),
        expected: "METRIC:FACTOR:PATIENCE with 0 < FACTOR < 1, such as val_loss:0.5:2",
    };
    let [metric, factor, patience] = text.split(':').collect::<Vec<_>>()[..] else { return Err(expected()) };
    let factor = factor.parse::<f64>().ok().filter(|f| *f > 0.0 && *f < 1.0).ok_or_else(expected)?;
    let patience = patience.parse::<u32>().ok().filter(|&p| p > 0).ok_or_else(expected)?;
    let watch = Watch { metric: known(flag, text, metric, names)?, patience, min_delta: PLATEAU_MIN_DELTA };
    Ok((watch, factor))
}

/// Whether a lower value of `metric` is better: a loss or an error (`val_loss`,
/// `mean_absolute_error`); anything else (accuracy) is maximised.
pub(crate) fn minimised(metric: &str) -> bool {
    metric.contains("loss") || metric.contains("error")
}

/// `METRIC[:min|max]` of `--keep-best`, its METRIC one of `names`; the mode, when not given, as
/// [`minimised`] says.
pub(crate) fn parse_keep_best(text: &str, names: &[String]) -> Result<(String, trainerd_storage::Mode), FlagError> {
    use trainerd_storage::Mode;
    let flag = "--keep-best";
    let (metric, mode) = match text.split(':').collect::<Vec<_>>()[..] {
        [m] => (m, if minimised(m) { Mode::Min } else { Mode::Max }),
        [m, "min"] => (m, Mode::Min),
        [m, "max"] => (m, Mode::Max),
        _ => {
            let expected = "METRIC[:min|max], such as val_accuracy or val_loss:min";
            return Err(FlagError::Form { flag, text: text.into(), expected });
        }
    };
    Ok((known(flag, text, metric, names)?, mode))
}

fn known(flag: &'static str, text: &str, metric: &str, names: &[String]) -> Result<String, FlagError> {
    if names.iter().any(|n| n == metric) {
        return Ok(metric.to_string());
    }
    Err(FlagError::NoFigure { flag, text: text.into(), metric: metric.into(), names: names.to_vec() })
}

/// The figures a run can watch: the training means of `metrics` (with the loss) and, when it
/// evaluates, the same on the test split as `val_NAME`.
pub(crate) fn figure_names(metrics: &[String], evaluates: bool) -> Vec<String> {
    let train: Vec<String> = std::iter::once("loss".to_string()).chain(metrics.iter().cloned()).collect();
    let val: Vec<String> = if evaluates { train.iter().map(|n| format!("val_{n}")).collect() } else { Vec::new() };
    train.into_iter().chain(val).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        figure_names(&["accuracy".to_string()], true)
    }

    #[test]
    fn flags_name_what_they_expect() {
        assert_eq!(names(), ["loss", "accuracy", "val_loss", "val_accuracy"]);
        assert_eq!(
            parse_early_stopping("val_loss:3", &names()),
            Ok(Watch { metric: "val_loss".into(), patience: 3, min_delta: 0.0 })
        );
        assert_eq!(
            parse_early_stopping("val_acc:3", &names()).unwrap_err().to_string(),
            "--early-stopping val_acc:3: no figure named val_acc; this run has loss, accuracy, val_loss, val_accuracy"
        );
        assert_eq!(
            parse_early_stopping("val_loss", &names()).unwrap_err().to_string(),
            "--early-stopping val_loss: expected METRIC:PATIENCE[:MIN_DELTA], such as val_loss:3 or val_accuracy:2:0.001"
        );
        assert_eq!(parse_reduce_lr("loss:0.5:2", &names()).map(|(w, f)| (w.patience, f)), Ok((2, 0.5)));
        use trainerd_storage::Mode;
        assert_eq!(parse_keep_best("val_accuracy", &names()), Ok(("val_accuracy".into(), Mode::Max)));
        assert_eq!(parse_keep_best("val_loss", &names()), Ok(("val_loss".into(), Mode::Min)));
        assert_eq!(parse_keep_best("val_accuracy:min", &names()), Ok(("val_accuracy".into(), Mode::Min)));
        assert_eq!(
            parse_keep_best("val_acc", &names()).unwrap_err().to_string(),
            "--keep-best val_acc: no figure named val_acc; this run has loss, accuracy, val_loss, val_accuracy"
        );
        assert_eq!(
            parse_keep_best("val_loss:lowest", &names()).unwrap_err().to_string(),
            "--keep-best val_loss:lowest: expected METRIC[:min|max], such as val_accuracy or val_loss:min"
        );
        assert!(minimised("val_mean_absolute_error") && !minimised("val_accuracy"));
        assert_eq!(
            parse_reduce_lr("loss:2:2", &names()).unwrap_err().to_string(),
            "--reduce-lr-on-plateau loss:2:2: expected METRIC:FACTOR:PATIENCE with 0 < FACTOR < 1, such as val_loss:0.5:2"
        );
    }

    #[test]
    fn losses_are_minimised_and_other_figures_maximised() {
        let callbacks = Callbacks {
            early_stopping: Some(Watch { metric: "val_accuracy".into(), patience: 2, min_delta: 0.01 }),
            reduce_lr_on_plateau: Some((Watch { metric: "val_loss".into(), patience: 1, min_delta: 1e-4 }, 0.5)),
        };
        let mut state = CallbackState::default();
        let epoch = |e: u32, loss: f64, acc: f64, s: &mut CallbackState| {
            callbacks.epoch_end(e, &[("val_loss".into(), loss), ("val_accuracy".into(), acc)], s)
        };
        assert_eq!(epoch(1, 1.0, 0.50, &mut state), Acted::default());
        assert_eq!(epoch(2, 0.9, 0.505, &mut state), Acted::default(), "0.005 is within min_delta");
        let third = epoch(3, 0.95, 0.52, &mut state);
        assert_eq!(third.stop, None, "0.52 improves on 0.50 by more than 0.01");
        assert_eq!(
            third.reduced.as_deref(),
            Some("val_loss has not improved for 1 epoch(s) (best 0.9000): learning rate x0.5 (x0.5 in all)")
        );
        assert_eq!(state.lr_scale, 0.5);
        assert_eq!(epoch(4, 0.99, 0.52, &mut state).stop, None);
        let fifth = epoch(5, 0.99, 0.51, &mut state);
        assert_eq!(
            fifth.stop.as_deref(),
            Some(
                "val_accuracy has not improved by more than 0.01 for 2 epoch(s) (best 0.5200): stopping after epoch 5"
            )
        );
        assert_eq!((state.stopped_after, state.lr_scale), (Some(5), 0.125), "reduced at epochs 3, 4 and 5");
        assert!(!state.is_unused() && CallbackState::default().is_unused());
    }
}
