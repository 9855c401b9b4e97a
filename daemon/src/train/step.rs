//! One training step and one evaluation pass, and the totals they produce.
//!
//! A step is computed per slot (virtual rank, [`crate::collective::slots`]): a worker holding
//! several computes them one after the other. Its all-reduce carries, besides the gradients, the
//! step's loss and metric sums (so the progress line shows global figures), one stop flag per
//! slot and one return flag per slot: a member that received SIGTERM raises its slots' stop
//! flags, the coordinator's process raises the return flags of the slots of each rank that came
//! back, and since every member sees the same reduced flags, they all stop, or end the
//! generation, after the same step without another message. (Both sets of flags are one per
//! slot, so the buffer's layout, and with it every sum's order, depends on the run's slots
//! only.)

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use trainerd_sdk::{Batch, InputContext};

use super::error::TrainError;
use crate::collective::buckets::{Buckets, TAIL};
use crate::collective::overlap::{overlapped, Overlap};
use crate::collective::{Collective, ReduceOp};
use crate::input::Data;
use crate::optim::precision::Precision;
use crate::plugin::ModelInstance;
use crate::state::host::host_bytes;
use crate::state::Totals;

pub(crate) fn torch(what: &'static str) -> impl FnOnce(tch::TchError) -> TrainError {
    move |source| TrainError::Torch { what, source }
}

/// `batch`'s columns on `device`.
pub(crate) fn on_device(batch: &Batch, device: Device) -> Result<Batch, TrainError> {
    batch.map(|t| t.f_to_device(device)).map_err(torch("moving the batch to the device"))
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
pub(crate) type Variables<'a> = (&'a mut [(String, Tensor)], &'a mut [(String, Tensor)]);

/// What a step produced, the same on every member.
pub(crate) struct StepResult {
    /// The step's totals over every slot.
    pub(crate) totals: Totals,
    /// The slots whose workers asked to stop after this step.
    pub(crate) stopping: Vec<usize>,
    /// The slots whose ranks came back: the generation ends after this step.
    pub(crate) returning: Vec<usize>,
    /// They caught up: every member joins with the lineage digest.
    pub(crate) caught_up: bool,
    /// Where this worker's time in it went.
    pub(crate) times: StepTimes,
}

/// Where a worker's time in a step went, up to the update.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StepTimes {
    /// Every slot's forward and backward pass (the reductions overlapped with the last one
    /// included).
    pub(crate) compute: Duration,
    /// From the last backward pass's end to the last reduction's end (with the sharded step, to
    /// its update's end): the communication the backward pass did not hide. The next batch made
    /// meanwhile is not counted.
    pub(crate) exposed: Duration,
}

/// What a worker raises in a step's tail: its stop flag, and the slots of the ranks that came
/// back (known to the coordinator's process only).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Raised<'f> {
    /// This worker asks to stop after the step.
    pub(crate) stop: bool,
    /// Per slot of the run: its rank came back (empty: none did).
    pub(crate) back: &'f [bool],
    /// Those ranks caught up (docs/fault-tolerance.md, "A return that does not pause the
    /// survivors"): every member joins with the lineage digest.
    pub(crate) caught_up: bool,
}

/// One slot's part of a step: its slice of the global batch and its dropout seed.
pub(crate) struct SlotBatch<'b> {
    /// Its columns.
    pub(crate) columns: &'b Batch,
    /// The seed of libtorch's generator for this slot's forward pass.
    pub(crate) seed: i64,
}

/// One model instance of this worker and its variables: the worker's only one, or one per device
/// with `--devices` ([`super::replicas`]), the first holding the state.
pub(crate) struct Replica<'s> {
    /// The model.
    pub(crate) model: &'s ModelInstance<'s>,
    /// Where it computes.
    pub(crate) device: Device,
    /// Its parameters.
    pub(crate) params: &'s mut [(String, Tensor)],
    /// Its buffers.
    pub(crate) buffers: &'s mut [(String, Tensor)],
    /// The forward pass's precision.
    pub(crate) precision: Precision,
    /// What the loss is multiplied by before backward (float16's loss scale; else 1).
    pub(crate) loss_scale: f64,
}

/// Forward, loss and backward of every slot this worker holds (`batches`, in slot order): the
/// replicas take them in rounds (slot i on replica i mod R; on CUDA a round's replicas compute at
/// once), each slot from the buffers' values at the step's start (`start`, needed when more than
/// one slot is held); then the gradients averaged over the run's slots into the first replica's
/// (with `raised`: the stop flag of this worker's slots and the return flags) and its buffers made
/// the same on every member ([`sync_slot_buffers`]). `meanwhile` runs once the devices have their work and before
/// the host waits for it. `reduce` reduces what the slots staged (the all-reduce, which leaves
/// the update to the caller, or the sharded step's reduction, which applies it); it returns the
/// tail's extra values summed.
pub(crate) fn train_step(
    replicas: &mut [Replica<'_>],
    (buckets, reduce, overlap): (&mut Buckets, &mut Reduce<'_>, Option<Overlap<'_>>),
    collective: &mut dyn Collective,
    (batches, start): (&[SlotBatch<'_>], &[Tensor]),
    raised: Raised<'_>,
    meanwhile: &mut dyn FnMut(),
) -> Result<StepResult, TrainError> {
    let slots = collective.slots().clone();
    debug_assert_eq!(batches.len(), slots.len());
    let began = Instant::now();
    buckets.begin_step(collective.on_device(), (replicas.len() == 1).then(|| batches.len() - 1));
    let mut captured = Vec::with_capacity(batches.len());
    let (mut flags, mut backward_end, mut aside) = (0, began, Duration::ZERO);
    let per_round = replicas.len();
    // With one replica, the last slot's buckets are reduced during its backward pass.
    let overlap = overlap.filter(|_| per_round == 1 && slots.count > 1);
    let bucket_count = buckets.groups().len();
    for (round, group) in batches.chunks(per_round).enumerate() {
        let last_round = (round + 1) * per_round >= batches.len();
        let mut then = || {
            backward_end = Instant::now();
            meanwhile();
            aside = backward_end.elapsed();
        };
        let on = (&mut *buckets, &mut *collective, overlap.filter(|_| last_round));
        let outputs =
            compute_round(replicas, on, (round, group, batches.len()), start, last_round.then_some(&mut then))?;
        for (r, (n, loss, metrics)) in outputs.into_iter().enumerate() {
            let totals = batch_totals(n, &loss, &metrics)?;
            if slots.count == 1 {
                let stopping = if raised.stop { vec![0] } else { Vec::new() };
                let times = StepTimes { compute: backward_end - began, exposed: Duration::ZERO };
                return Ok(StepResult { totals, stopping, returning: Vec::new(), caught_up: false, times });
            }
            flags = totals.flat().len();
            let extra = tail_values(&totals, &slots, raised, round == 0 && r == 0);
            let params: Vec<&Tensor> = replicas[r].params.iter().map(|(_, p)| p).collect();
            // Overlapped, the buckets after the tail's are staged (and reduced) already.
            let which = if overlap.is_some() && last_round { TAIL..TAIL + 1 } else { 0..bucket_count };
            buckets.stage_buckets(round * per_round + r, &params, &extra, which);
            if !replicas[r].buffers.is_empty() {
                captured.push(capture(replicas[r].buffers)?);
            }
        }
    }
    let first = &mut replicas[0];
    let extra = reduce(buckets, collective, first.params, batches.len())?;
    sync_slot_buffers(collective, first.buffers, captured)?;
    let times = StepTimes { compute: backward_end - began, exposed: backward_end.elapsed().saturating_sub(aside) };
    let reduced: Vec<f64> = extra[..flags].iter().map(|&x| f64::from(x)).collect();
    let back = flags + slots.count;
    Ok(StepResult {
        totals: Totals::from_flat(&reduced),
        stopping: (0..slots.count).filter(|&s| extra[flags + s] > 0.0).collect(),
        returning: (0..slots.count).filter(|&s| extra[back + s] > 0.0).collect(),
        caught_up: (0..slots.count).any(|s| extra[back + s] > 1.5),
        times,
    })
}

/// What a slot's gradients carry in the tail's bucket ([`TAIL`]): its `totals` (as float32), then one stop flag
/// and one return flag per slot of the run. The return flags are raised on one slot per worker
/// (`first`), so that the reduced value is the raised one: 1 for a return, 2 for a caught-up
/// return.
fn tail_values(totals: &Totals, slots: &crate::collective::Slots, raised: Raised<'_>, first: bool) -> Vec<f32> {
    let mut extra: Vec<f32> = totals.flat().iter().map(|&x| x as f32).collect();
    extra.extend((0..slots.count).map(|s| if slots.holds(s) && raised.stop { 1.0 } else { 0.0 }));
    let value = if raised.caught_up { 2.0 } else { 1.0 };
    extra.extend((0..slots.count).map(|s| if first && raised.back.get(s) == Some(&true) { value } else { 0.0 }));
    extra
}

/// Forward, loss and backward of round `round`'s slots (`group`, of `held` held), one per
/// replica, each from the buffers' values at the step's start (`start`) after the first round;
/// `then` runs after the last backward pass. With `overlap` (one replica, the last round), the
/// buckets after the tail's are staged and reduced during the backward pass ([`overlapped`]).
fn compute_round<'c>(
    replicas: &mut [Replica<'_>],
    (buckets, collective, overlap): (&mut Buckets, &mut (dyn Collective + 'c), Option<Overlap<'_>>),
    (round, group, held): (usize, &[SlotBatch<'_>], usize),
    start: &[Tensor],
    then: Option<&mut dyn FnMut()>,
) -> Result<Vec<(i64, Tensor, Tensor)>, TrainError> {
    let start = (round > 0).then_some(start);
    let Some(overlap) = overlap else {
        let mut outputs = Vec::with_capacity(group.len());
        for (replica, batch) in replicas.iter_mut().zip(group) {
            outputs.push(forward_backward(replica, batch, start)?);
        }
        then.into_iter().for_each(|then| then());
        return Ok(outputs);
    };
    let replica = &mut replicas[0];
    let params: Vec<Tensor> = replica.params.iter().map(|(_, p)| p.shallow_clone()).collect();
    let params: Vec<&Tensor> = params.iter().collect();
    let (out, _) = overlapped((buckets, collective), ((round, held), params.as_slice(), overlap), || {
        let out = forward_backward(replica, &group[0], start)?;
        then.into_iter().for_each(|then| then());
        Ok::<_, TrainError>(out)
    })?;
    Ok(vec![out])
}

/// How a step's staged gradients are reduced: (buckets, collective, the first replica's
/// parameters, slots held) to the tail's extra values.
pub(crate) type Reduce<'r> = dyn FnMut(
        &mut Buckets,
        &mut dyn Collective,
        &mut [(String, Tensor)],
        usize,
    ) -> Result<Vec<f32>, crate::collective::CollectiveError>
    + 'r;

/// One slot's forward pass, loss and backward on `replica` (its buffers first put back to the
/// step's `start` when given): (examples, loss, metrics).
fn forward_backward(
    replica: &mut Replica<'_>,
    batch: &SlotBatch<'_>,
    start: Option<&[Tensor]>,
) -> Result<(i64, Tensor, Tensor), TrainError> {
    if let Some(start) = start {
        let _no_grad = tch::no_grad_guard();
        for ((_, b), s) in replica.buffers.iter_mut().zip(start) {
            b.f_copy_(s).map_err(torch("resetting the buffers"))?;
        }
    }
    let columns = on_device(batch.columns, replica.device)?;
    tch::manual_seed(batch.seed);
    let autocast = replica.precision.autocast(replica.device).map_err(torch("entering autocast"))?;
    let (loss, metrics) = replica.model.step(&columns, true)?;
    drop(autocast);
    // A loss computed in the low precision (a plugin's own) is scaled and differentiated in float32.
    let loss = match loss.kind() {
        Kind::Half | Kind::BFloat16 => loss.f_to_kind(Kind::Float).map_err(torch("the loss in float32"))?,
        _ => loss,
    };
    crate::sys::autograd::zero_grads(replica.params);
    if replica.loss_scale == 1.0 {
        loss.f_backward().map_err(torch("backward"))?;
    } else {
        loss.f_mul_scalar(replica.loss_scale).and_then(|l| l.f_backward()).map_err(torch("backward"))?;
    }
    Ok((columns.examples(), loss, metrics))
}

/// One slot's buffers after its forward pass: the floating-point ones as float64, the others'
/// bytes.
pub(crate) struct Captured {
    floating: Vec<f64>,
    other: Vec<u8>,
}

/// This slot's buffers as they stand.
fn capture(buffers: &[(String, Tensor)]) -> Result<Captured, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let (mut floating, mut other) = (Vec::new(), Vec::new());
    let parts: Vec<Tensor> = buffers
        .iter()
        .filter(|(_, b)| b.is_floating_point())
        .map(|(_, b)| b.detach().reshape(-1).to_kind(Kind::Double))
        .collect();
    if !parts.is_empty() {
        let joined = Tensor::cat(&parts, 0).f_to_device(Device::Cpu).map_err(torch("reading the buffers"))?;
        floating = Vec::<f64>::try_from(&joined).map_err(torch("reading the buffers"))?;
    }
    for (_, b) in buffers.iter().filter(|(_, b)| !b.is_floating_point()) {
        other.extend(host_bytes(b).map_err(torch("reading the buffers"))?);
    }
    Ok(Captured { floating, other })
}

/// Makes every member's buffers identical after a step, from each slot's own: floating-point
/// buffers (BatchNorm's running statistics, which each slot updated from its own shard) take their
/// mean over the run's slots, as TensorFlow's MirroredStrategy aggregates BatchNorm's moving
/// statistics; the mean is taken in float64 in the slots' ring order, so a buffer that is
/// already the same everywhere keeps its exact value, and the result is the same whoever holds
/// which slots. Other buffers (counters, masks) take slot 0's values, bit for bit.
pub(crate) fn sync_slot_buffers(
    collective: &mut dyn Collective,
    buffers: &mut [(String, Tensor)],
    mut captured: Vec<Captured>,
) -> Result<(), TrainError> {
    if collective.slots().count == 1 || buffers.is_empty() {
        return Ok(());
    }
    let _no_grad = tch::no_grad_guard();
    let floating: Vec<usize> = (0..buffers.len()).filter(|&i| buffers[i].1.is_floating_point()).collect();
    if !floating.is_empty() {
        let mut views: Vec<&mut [f64]> = captured.iter_mut().map(|c| c.floating.as_mut_slice()).collect();
        collective.all_reduce_values(&mut views, ReduceOp::Mean)?;
        let mean = Tensor::from_slice(&*views[0]);
        let mut at = 0;
        for &i in &floating {
            let b = &mut buffers[i].1;
            let n = b.numel() as i64;
            b.f_copy_(&mean.narrow(0, at, n).view_as(b)).map_err(torch("writing the buffers"))?;
            at += n;
        }
    }
    if floating.len() < buffers.len() {
        // Slot 0's holder sends them (the first worker of the ring, or with home slots the last
        // when its slots wrap past the last slot); the others' are the same length.
        let slots = collective.slots();
        let root = slots.holder_place(0);
        let mut bytes = std::mem::take(&mut captured[slots.index(0).unwrap_or(0)].other);
        collective.broadcast(root, &mut bytes)?;
        let mut at = 0;
        for (_, b) in buffers.iter_mut().filter(|(_, b)| !b.is_floating_point()) {
            let len = b.numel() * b.kind().elt_size_in_bytes();
            let first = Tensor::f_from_data_size(&bytes[at..at + len], &b.size(), b.kind())
                .map_err(torch("writing the buffers"))?;
            b.f_copy_(&first).map_err(torch("writing the buffers"))?;
            at += len;
        }
    }
    Ok(())
}

/// [`sync_slot_buffers`] for a worker holding one slot, from the buffers as they stand.
#[cfg(test)]
pub(crate) fn sync_buffers(
    collective: &mut dyn Collective,
    buffers: &mut [(String, Tensor)],
) -> Result<(), TrainError> {
    if collective.slots().count == 1 || buffers.is_empty() {
        return Ok(());
    }
    let captured = vec![capture(buffers)?];
    sync_slot_buffers(collective, buffers, captured)
}

/// Loss and metrics over one pass of the test split (each slot held here its shard: `ctxs`, in
/// slot order), without gradients, summed over the run's slots. `done` holds the sums of shards
/// already evaluated on these parameters (by slot): an evaluation abandoned when a peer failed is
/// taken up again without redoing them, and every shard computed here is added to it. Between
/// batches the generation's abort is checked, so that a failure stops the pass at once.
pub(crate) fn evaluate(
    model: &ModelInstance<'_>,
    data: &Data<'_>,
    ctxs: &[InputContext],
    collective: &mut dyn Collective,
    (device, metrics, precision): (Device, usize, Precision),
    done: &mut BTreeMap<u32, Vec<f64>>,
) -> Result<Totals, TrainError> {
    let _no_grad = tch::no_grad_guard();
    let _autocast = precision.autocast(device).map_err(torch("entering autocast"))?;
    let mut sums = Vec::with_capacity(ctxs.len());
    for ctx in ctxs {
        if let Some(shard) = done.get(&ctx.input_pipeline_id) {
            sums.push(shard.clone());
            continue;
        }
        let mut batches = data.open(ctx, (ctx.epoch as u32 + 1, u64::MAX))?;
        let mut totals = Totals::new(metrics);
        while let Some(crate::input::Batch { columns, .. }) = batches.next_batch()? {
            collective.check_abort()?;
            let n = columns.examples();
            if n == 0 {
                continue; // this pipeline's share of the last global batch is empty
            }
            let columns = on_device(&columns, device)?;
            let (loss, metrics) = model.step(&columns, false)?;
            totals.add(&batch_totals(n, &loss, &metrics)?);
            // Chaos tests stop a member here: a failure in the middle of an evaluation.
            trainerd_failpoint::point("evaluate");
        }
        done.insert(ctx.input_pipeline_id, totals.flat());
        sums.push(totals.flat());
    }
    let mut views: Vec<&mut [f64]> = sums.iter_mut().map(Vec::as_mut_slice).collect();
    collective.all_reduce_values(&mut views, ReduceOp::Sum)?;
    Ok(Totals::from_flat(views[0]))
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
