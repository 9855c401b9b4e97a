//! Running sums over a step, an epoch or an evaluation: examples, loss × examples, and each
//! metric's sum. Sums, not means, so that adding steps and adding workers is exact in any grouping
//! of the same order.
//!
//! On the wire (an all-reduce) and in checkpoints they keep one flat layout, `[loss × n, n,
//! metric...]`, the layout of trainerd's first checkpoints: [`Totals::flat`] and
//! [`Totals::from_flat`] are the only places that know it, so a checkpoint committed before
//! totals were typed resumes bit for bit.

use serde::{Deserialize, Serialize};

/// Sums of examples, loss × examples and metrics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "Vec<f64>", into = "Vec<f64>")]
pub(crate) struct Totals {
    loss: f64,
    examples: f64,
    metrics: Vec<f64>,
}

impl Totals {
    /// Zero sums for `metrics` metrics.
    pub(crate) fn new(metrics: usize) -> Totals {
        Totals { metrics: vec![0.0; metrics], ..Default::default() }
    }

    /// One batch's sums: `n` examples of mean loss `loss` and metric sums `metrics`.
    pub(crate) fn of_batch(n: i64, loss: f64, metrics: Vec<f64>) -> Totals {
        Totals { loss: loss * n as f64, examples: n as f64, metrics }
    }

    /// Sums laid out as `[loss × n, n, metric...]` (an all-reduce's buffer, a checkpoint's).
    pub(crate) fn flat(&self) -> Vec<f64> {
        let mut v = vec![self.loss, self.examples];
        v.extend(&self.metrics);
        v
    }

    /// Sums from the layout of [`Totals::flat`]; no sums (zero examples, no metrics) when
    /// `flat` is too short to hold the two first.
    pub(crate) fn from_flat(flat: &[f64]) -> Totals {
        match flat {
            [loss, examples, metrics @ ..] => Totals { loss: *loss, examples: *examples, metrics: metrics.to_vec() },
            _ => Totals::default(),
        }
    }

    /// Adds `other`'s sums to these.
    pub(crate) fn add(&mut self, other: &Totals) {
        self.loss += other.loss;
        self.examples += other.examples;
        self.metrics.iter_mut().zip(&other.metrics).for_each(|(m, s)| *m += s);
    }

    /// Examples counted.
    pub(crate) fn examples(&self) -> f64 {
        self.examples
    }

    /// Mean loss.
    pub(crate) fn loss_mean(&self) -> f64 {
        self.loss / self.examples.max(1.0)
    }

    /// Mean of each metric.
    pub(crate) fn metric_means(&self) -> Vec<f64> {
        self.metrics.iter().map(|m| m / self.examples.max(1.0)).collect()
    }

    /// `(PREFIXloss, mean), (PREFIXmetric, mean)...`.
    pub(crate) fn named(&self, names: &[String], prefix: &str) -> Vec<(String, f64)> {
        std::iter::once((format!("{prefix}loss"), self.loss_mean()))
            .chain(names.iter().zip(self.metric_means()).map(|(n, m)| (format!("{prefix}{n}"), m)))
            .collect()
    }
}

/// An epoch's figures by name, as the epoch line shows them: the training means of `metrics`
/// (with the loss) from `train`, then the same from `eval` as `val_NAME`.
pub(crate) fn epoch_figures(metrics: &[String], train: &Totals, eval: Option<&Totals>) -> Vec<(String, f64)> {
    let mut figures = train.named(metrics, "");
    figures.extend(eval.map(|e| e.named(metrics, "val_")).unwrap_or_default());
    figures
}

impl From<Vec<f64>> for Totals {
    fn from(flat: Vec<f64>) -> Totals {
        Totals::from_flat(&flat)
    }
}

impl From<Totals> for Vec<f64> {
    fn from(t: Totals) -> Vec<f64> {
        t.flat()
    }
}

/// `Option<Totals>` as a checkpoint holds it: an empty list for none (before the first
/// evaluation), as trainerd's first checkpoints wrote it.
pub(crate) mod optional {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::Totals;

    /// `None` as `[]`.
    pub(crate) fn serialize<S: Serializer>(value: &Option<Totals>, s: S) -> Result<S::Ok, S::Error> {
        value.as_ref().map_or_else(Vec::new, Totals::flat).serialize(s)
    }

    /// `[]` (or an absent field, with `#[serde(default)]`) as `None`.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Totals>, D::Error> {
        let flat = Vec::<f64>::deserialize(d)?;
        Ok((!flat.is_empty()).then(|| Totals::from_flat(&flat)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_add_and_name_their_means() {
        let mut t = Totals::new(1);
        t.add(&Totals::of_batch(4, 0.5, vec![3.0]));
        t.add(&Totals::of_batch(6, 1.0, vec![3.0]));
        assert_eq!(t.examples(), 10.0);
        assert_eq!(t.named(&["accuracy".into()], "val_"), [("val_loss".into(), 0.8), ("val_accuracy".into(), 0.6)]);
    }

    #[test]
    fn the_flat_layout_is_the_first_checkpoints_and_round_trips() {
        let t = Totals::of_batch(64, 0.25, vec![40.0, 2.0]);
        assert_eq!(t.flat(), [16.0, 64.0, 40.0, 2.0]);
        assert_eq!(serde_json::to_string(&t).unwrap(), "[16.0,64.0,40.0,2.0]");
        assert_eq!(serde_json::from_str::<Totals>("[16.0,64.0,40.0,2.0]").unwrap(), t);
        assert_eq!(Totals::from_flat(&[]), Totals::default());
    }
}
