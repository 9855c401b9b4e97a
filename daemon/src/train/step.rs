//! One training step and one evaluation pass, and the totals they produce.
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
use crate::input::Data;
use crate::plugin::ModelInstance;
use crate::state::host::host_bytes;
use crate::state::Totals;

fn torch(what: &'static str) -> impl FnOnce(tch::TchError) -> TrainError {
    move |source| TrainError::Torch { what, source }
}

/// One batch's totals from the plugin's outputs on its `n` examples.
fn batch_totals(n: i64, loss: &Tensor, metrics: &Tensor) -> Result<Totals, TrainError> {
    let loss = loss.f_double_value(&[]).map_err(torch("reading the loss"))?;
    let metrics = Vec::<f64>::try_from(
        metrics.f_to_device(Device::Cpu).and_then(|m| m.f_to_kind(Kind::Double)).map_err(torch("reading metrics"))?,
    )
    .map_err(torch("reading metrics"))?;
    Ok(Totals::of_batch(n, loss, metrics))
}

/// A model's variables as a step changes them: (parameters, buffers).
pub type Variables<'a> = (&'a mut [(String, Tensor)], &'a mut [(String, Tensor)]);

/// What a step produced, the same on every member.
pub struct StepResult {
    /// The step's totals over every member.
    pub totals: Totals,
    /// The ranks that asked to stop after this step.
    pub stopping: Vec<usize>,
}

/// Forward, loss and backward on this worker's slice of the global batch (on the device), then the gradients
/// averaged over the ring (with `stop` as this rank's stop flag) and the buffers the forward pass
/// updated made the same on every member ([`sync_buffers`]). `meanwhile` runs once the device
/// has its work and before the host waits for it. The parameters are untouched: the caller
/// applies the update once this returns.
pub fn train_step(
    model: &ModelInstance<'_>,
    (params, buffers): Variables<'_>,
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
    let totals = batch_totals(xs.size()[0], &loss, &metrics)?;
    let (rank, world) = (ring.rank(), ring.world());
    if world == 1 {
        return Ok(StepResult { totals, stopping: if stop { vec![0] } else { Vec::new() } });
    }
    // The totals ride in the gradients' all-reduce (as float32), then one stop flag per rank.
    let mut extra: Vec<f32> = totals.flat().iter().map(|&x| x as f32).collect();
    let flags = extra.len();
    extra.extend((0..world).map(|r| if r == rank && stop { 1.0 } else { 0.0 }));
    buckets.all_reduce(ring, params, &mut extra)?;
    sync_buffers(ring, buffers)?;
    let reduced: Vec<f64> = extra[..flags].iter().map(|&x| f64::from(x)).collect();
    Ok(StepResult {
        totals: Totals::from_flat(&reduced),
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
            bytes.extend(host_bytes(&buffers[i].1).map_err(torch("reading the buffers"))?);
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
    data: &Data<'_>,
    ctx: &InputContext,
    ring: &mut Ring,
    device: Device,
    metrics: usize,
) -> Result<Totals, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let mut batches = data.open(ctx, (ctx.epoch as u32 + 1, u64::MAX))?;
    let mut totals = Totals::new(metrics);
    while let Some(crate::input::Batch { xs, ys: labels, .. }) = batches.next_batch()? {
        let n = xs.size()[0];
        if n == 0 {
            continue; // this pipeline's share of the last global batch is empty
        }
        let xs = xs.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let labels = labels.f_to_device(device).map_err(torch("moving the batch to the device"))?;
        let logits = model.forward(&xs, false)?;
        totals.add(&batch_totals(n, &model.loss(&logits, &labels)?, &model.metrics(&logits, &labels)?)?);
    }
    let mut sums = totals.flat();
    ring.all_reduce(&mut sums, ReduceOp::Sum)?;
    Ok(Totals::from_flat(&sums))
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
            buffers.into_iter().map(|(_, t)| (t.kind(), host_bytes(&t).unwrap())).collect::<Vec<_>>()
        });
        let bytes = |t: Tensor| (t.kind(), host_bytes(&t).unwrap());
        for got in out {
            assert_eq!(got[0], bytes(Tensor::from_slice(&[1.0f32, 0.1])), "float32: the mean, 0.1 exactly kept");
            assert_eq!(got[1], bytes(Tensor::from_slice(&[1.0f64 / 3.0, 3.0])), "float64: the mean");
            assert_eq!(got[2], bytes(Tensor::from_slice(&[(1i64 << 53) + 1])), "int64: the chief's, exactly");
            assert_eq!(got[3], bytes(Tensor::from_slice(&[7u8])), "uint8: the chief's");
        }
    }
}
