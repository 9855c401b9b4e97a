//! One training step and one evaluation pass, and the running sums they produce.
//!
//! A step's all-reduce carries, besides the gradients, the step's loss and metric sums (so the
//! progress line shows global figures) and one stop flag per rank: a member that received
//! SIGTERM raises its flag, and since every member sees the same reduced flags, they all stop at
//! the same step without another message.

use tch::{Device, Kind, Tensor};
use trainerd_sdk::InputContext;

use super::TrainError;
use crate::checkpoint;
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
/// averaged over the ring (with `stop` as this rank's stop flag) and the buffers the forward pass
/// updated made the same on every member ([`sync_buffers`]). `meanwhile` runs once the device
/// has its work and before the host waits for it. The parameters are untouched: the caller
/// applies the update once this returns.
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    model: &ModelInstance<'_>,
    params: &mut [(String, Tensor)],
    buffers: &mut [(String, Tensor)],
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
    sync_buffers(ring, buffers)?;
    Ok(StepResult {
        sums: extra[..flags].iter().map(|&x| f64::from(x)).collect(),
        stopping: (0..world).filter(|&r| extra[flags + r] > 0.0).collect(),
    })
}

/// Makes every member's buffers identical after a step. Floating-point buffers (BatchNorm's
/// running statistics, which each member updated from its own shard) take their mean over the
/// members, as TensorFlow's MirroredStrategy aggregates BatchNorm's moving statistics; the mean
/// is taken in float64, so a buffer that is already the same everywhere keeps its exact value.
/// Other buffers (counters, masks) take the chief's values, bit for bit.
pub fn sync_buffers(ring: &mut Ring, buffers: &mut [(String, Tensor)]) -> Result<(), TrainError> {
    if ring.world() == 1 || buffers.is_empty() {
        return Ok(());
    }
    let _no_grad = tch::no_grad_guard();
    let (floating, other): (Vec<usize>, Vec<usize>) =
        (0..buffers.len()).partition(|&i| buffers[i].1.is_floating_point());
    if !floating.is_empty() {
        let parts: Vec<Tensor> =
            floating.iter().map(|&i| buffers[i].1.detach().reshape(-1).to_kind(Kind::Double)).collect();
        let joined = Tensor::cat(&parts, 0).f_to_device(Device::Cpu).map_err(torch("reading the buffers"))?;
        let mut values = Vec::<f64>::try_from(&joined).map_err(torch("reading the buffers"))?;
        ring.all_reduce(&mut values, ReduceOp::Sum)?;
        let world = ring.world() as f64;
        values.iter_mut().for_each(|v| *v /= world);
        let mean = Tensor::from_slice(&values);
        let mut at = 0;
        for &i in &floating {
            let b = &mut buffers[i].1;
            let n = b.numel() as i64;
            b.f_copy_(&mean.narrow(0, at, n).view_as(b)).map_err(torch("writing the buffers"))?;
            at += n;
        }
    }
    if !other.is_empty() {
        let mut bytes = Vec::new();
        for &i in &other {
            bytes.extend(checkpoint::host_bytes(&buffers[i].1).map_err(torch("reading the buffers"))?);
        }
        ring.broadcast_from(0, &mut bytes)?;
        let mut at = 0;
        for &i in &other {
            let b = &mut buffers[i].1;
            let len = b.numel() * b.kind().elt_size_in_bytes();
            let chief = Tensor::f_from_data_size(&bytes[at..at + len], &b.size(), b.kind())
                .map_err(torch("writing the buffers"))?;
            b.f_copy_(&chief).map_err(torch("writing the buffers"))?;
            at += len;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_averaged_or_taken_from_the_chief_keeping_their_type() {
        let out = crate::collective::ring::tests::with_ring(3, |ring| {
            let r = ring.rank() as i64;
            let mut buffers = vec![
                ("mean".to_string(), Tensor::from_slice(&[r as f32, 0.1])),
                ("var".to_string(), Tensor::from_slice(&[1.0f64 / 3.0, r as f64 * 3.0])),
                ("count".to_string(), Tensor::from_slice(&[(1i64 << 53) + 1 + r])),
                ("flag".to_string(), Tensor::from_slice(&[r as u8 + 7])),
            ];
            sync_buffers(ring, &mut buffers).unwrap();
            buffers.into_iter().map(|(_, t)| (t.kind(), checkpoint::host_bytes(&t).unwrap())).collect::<Vec<_>>()
        });
        let bytes = |t: Tensor| (t.kind(), checkpoint::host_bytes(&t).unwrap());
        for got in out {
            assert_eq!(got[0], bytes(Tensor::from_slice(&[1.0f32, 0.1])), "float32: the mean, 0.1 exactly kept");
            assert_eq!(got[1], bytes(Tensor::from_slice(&[1.0f64 / 3.0, 3.0])), "float64: the mean");
            assert_eq!(got[2], bytes(Tensor::from_slice(&[(1i64 << 53) + 1])), "int64: the chief's, exactly");
            assert_eq!(got[3], bytes(Tensor::from_slice(&[7u8])), "uint8: the chief's");
        }
    }
}
