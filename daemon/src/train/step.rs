//! One training step and one evaluation pass, and the running sums they produce.
//!
//! A step's all-reduce carries, besides the gradients, the step's loss and metric sums (so the
//! progress line shows global figures) and one stop flag per rank: a member that received
//! SIGTERM raises its flag, and since every member sees the same reduced flags, they all stop at
//! the same step without another message.

use tch::{Device, Kind, Tensor};
use trainerd_sdk::InputContext;

use super::TrainError;
use crate::collective::buckets::Buckets;
use crate::collective::{ReduceOp, Ring};
use crate::plugin::{Dataset, ModelInstance};

/// Global sums over an epoch or an evaluation: examples, loss × examples, metric sums.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    examples: f64,
    loss: f64,
    metrics: Vec<f64>,
}

impl Totals {
    /// Zero sums for `metrics` metrics.
    pub fn new(metrics: usize) -> Totals {
        Totals { metrics: vec![0.0; metrics], ..Default::default() }
    }

    /// Totals from sums laid out as [`Totals::sums`] (zeros if empty).
    pub fn from_sums(sums: &[f64], metrics: usize) -> Totals {
        let mut t = Totals::new(metrics);
        if sums.len() == 2 + metrics {
            t.add(sums);
        }
        t
    }

    /// `[loss × n, n, metric...]`.
    pub fn sums(&self) -> Vec<f64> {
        let mut v = vec![self.loss, self.examples];
        v.extend(&self.metrics);
        v
    }

    /// Adds one step's sums, laid out as `[loss × n, n, metric...]`.
    pub fn add(&mut self, sums: &[f64]) {
        self.loss += sums[0];
        self.examples += sums[1];
        self.metrics.iter_mut().zip(&sums[2..]).for_each(|(m, s)| *m += s);
    }

    /// Examples counted.
    pub fn examples(&self) -> f64 {
        self.examples
    }

    /// Mean loss.
    pub fn loss_mean(&self) -> f64 {
        self.loss / self.examples.max(1.0)
    }

    /// Mean of each metric.
    pub fn metric_means(&self) -> Vec<f64> {
        self.metrics.iter().map(|m| m / self.examples.max(1.0)).collect()
    }

    /// `(PREFIXloss, mean), (PREFIXmetric, mean)...`.
    pub fn named(&self, names: &[String], prefix: &str) -> Vec<(String, f64)> {
        std::iter::once((format!("{prefix}loss"), self.loss_mean()))
            .chain(names.iter().zip(self.metric_means()).map(|(n, m)| (format!("{prefix}{n}"), m)))
            .collect()
    }
}

fn torch(what: &'static str) -> impl FnOnce(tch::TchError) -> TrainError {
    move |source| TrainError::Torch { what, source }
}

/// One step's `[loss × n, n, metric...]` from the plugin's outputs.
fn step_sums(n: i64, loss: &Tensor, metrics: &Tensor) -> Result<Vec<f64>, TrainError> {
    let loss = loss.f_double_value(&[]).map_err(torch("reading the loss"))?;
    let metrics = Vec::<f64>::try_from(
        metrics.f_to_device(Device::Cpu).and_then(|m| m.f_to_kind(Kind::Double)).map_err(torch("reading metrics"))?,
    )
    .map_err(torch("reading metrics"))?;
    let mut sums = vec![loss * n as f64, n as f64];
    sums.extend(metrics);
    Ok(sums)
}

/// What a step produced, the same on every member.
pub struct StepResult {
    /// The step's global `[loss × n, n, metric...]`.
    pub sums: Vec<f64>,
    /// The ranks that asked to stop after this step.
    pub stopping: Vec<usize>,
}

/// Forward, loss and backward on this worker's slice of the global batch (on the device), then the gradients
/// averaged over the ring (with `stop` as this rank's stop flag). `meanwhile` runs once the
/// device has its work and before the host waits for it. The parameters are untouched: the
/// caller applies the update once this returns.
pub fn train_step(
    model: &ModelInstance<'_>,
    params: &mut [(String, Tensor)],
    buckets: &mut Buckets,
    ring: &mut Ring,
    (xs, labels): (&Tensor, &Tensor),
    stop: bool,
    meanwhile: &mut dyn FnMut(),
) -> Result<StepResult, TrainError> {
    let logits = model.forward(xs, true)?;
    let loss = model.loss(&logits, labels)?;
    let metrics = model.metrics(&logits.detach(), labels)?;
    for (_, p) in params.iter_mut() {
        p.zero_grad();
    }
    loss.f_backward().map_err(torch("backward"))?;
    meanwhile();
    let sums = step_sums(xs.size()[0], &loss, &metrics)?;
    let (rank, world) = (ring.rank(), ring.world());
    if world == 1 {
        return Ok(StepResult { sums, stopping: if stop { vec![0] } else { Vec::new() } });
    }
    let mut extra: Vec<f32> = sums.iter().map(|&x| x as f32).collect();
    let flags = extra.len();
    extra.extend((0..world).map(|r| if r == rank && stop { 1.0 } else { 0.0 }));
    buckets.all_reduce(ring, params, &mut extra)?;
    Ok(StepResult {
        sums: extra[..flags].iter().map(|&x| f64::from(x)).collect(),
        stopping: (0..world).filter(|&r| extra[flags + r] > 0.0).collect(),
    })
}

/// Loss and metrics over one pass of the test split (each worker its shard), without
/// gradients, summed over the ring.
pub fn evaluate(
    model: &ModelInstance<'_>,
    data: &Dataset<'_>,
    ctx: &InputContext,
    ring: &mut Ring,
    device: Device,
    metrics: usize,
) -> Result<Totals, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let mut pipeline = data.pipeline(ctx)?;
    let mut sums = vec![0f64; 2 + metrics];
    while let Some((xs, labels)) = pipeline.next_batch()? {
        let n = xs.size()[0];
        if n == 0 {
            continue; // this pipeline's share of the last global batch is empty
        }
        let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let logits = model.forward(&xs, false)?;
        let step = step_sums(n, &model.loss(&logits, &labels)?, &model.metrics(&logits, &labels)?)?;
        sums.iter_mut().zip(step).for_each(|(s, x)| *s += x);
    }
    ring.all_reduce(&mut sums, ReduceOp::Sum)?;
    Ok(Totals::from_sums(&sums, metrics))
}
