//! The training split's batches, by (epoch, step): the data's batches positioned at a step (a
//! resumed or recovered run starts mid-epoch; nothing before it is made), with the last two
//! batches kept on the device: the step in flight's, which a step abandoned and taken again needs
//! again, and the next one, made while the device computes the current step.

use std::collections::BTreeMap;

use tch::{Device, Tensor};
use trainerd_sdk::InputContext;

use super::error::TrainError;
use crate::input::{Batch, Data, Epochs};

/// The input context of worker `rank` of `world`, each taking `batch_size` examples of every
/// global batch, in `epoch` of a run seeded `seed`.
pub(crate) fn input_context(
    (rank, world): (usize, usize),
    batch_size: u32,
    (training, epoch, seed): (bool, u64, u64),
) -> InputContext {
    InputContext {
        num_input_pipelines: world as u32,
        input_pipeline_id: rank as u32,
        per_replica_batch_size: batch_size,
        training,
        epoch,
        seed,
        first_step: 0,
    }
}

/// The data's batches from some (epoch, step) on, and the last two it handed out (already on the
/// device).
struct Cursor<'d> {
    /// The (epoch, step) of the next batch it yields.
    next: (u32, u64),
    epochs: Epochs<'d>,
    recent: Vec<Batch>,
}

/// Batches `(epoch, step)` (0-based step) of the training split, on `device`, per input pipeline
/// (one per slot this worker holds), reopening the data only when it is not positioned there.
pub(crate) struct Batches<'d> {
    data: &'d Data<'d>,
    device: Device,
    /// The run's last epoch + 1, and the steps of each epoch.
    span: (u32, u64),
    /// Per input pipeline.
    cursors: BTreeMap<u32, Cursor<'d>>,
}

impl<'d> Batches<'d> {
    /// Batches of `data` on `device`, for a run of `span` (epochs, steps per epoch).
    pub(crate) fn new(data: &'d Data<'d>, device: Device, span: (u32, u64)) -> Batches<'d> {
        Batches { data, device, span, cursors: BTreeMap::new() }
    }

    /// Closes the pipelines of slots no longer held here (their streams and prefetch threads).
    pub(crate) fn keep(&mut self, held: &crate::collective::Slots) {
        self.cursors.retain(|&pipeline, _| held.holds(pipeline as usize));
    }

    /// The batch of step `step` (0-based) of `ctx`'s epoch: inputs, labels and (for a columnar
    /// dataset) example ids.
    pub(crate) fn get(&mut self, ctx: &InputContext, step: u64) -> Result<Batch, TrainError> {
        let at = (ctx.epoch as u32, step);
        let pipeline = ctx.input_pipeline_id;
        if let Some(b) = self.cursors.get(&pipeline).and_then(|c| c.recent.iter().find(|b| (b.epoch, b.step) == at)) {
            return Ok(shallow(b));
        }
        let batch = match self.pull(ctx, at) {
            Ok(batch) => batch,
            Err(e) => {
                // Data that failed is not trusted to go on: the next request starts afresh (and
                // meets the same error, if a prefetch swallowed it).
                self.cursors.remove(&pipeline);
                return Err(e);
            }
        };
        let c = self.cursors.get_mut(&pipeline).expect("positioned");
        // A columnar dataset's stream goes on into the next epoch; a plugin's pipeline ends with
        // its epoch, and is found ended there.
        c.next = if at.1 + 1 < self.span.1 { (at.0, at.1 + 1) } else { (at.0 + 1, 0) };
        if c.recent.len() == 2 {
            let _ = c.recent.remove(0);
        }
        c.recent.push(shallow(&batch));
        Ok(batch)
    }

    /// The batch at `at`, from the cursor when it is positioned there, else from the data
    /// reopened there (a plugin's pipeline ends with its epoch: the next one is opened then).
    fn pull(&mut self, ctx: &InputContext, at: (u32, u64)) -> Result<Batch, TrainError> {
        for reopened in [false, true] {
            let pipeline = ctx.input_pipeline_id;
            if reopened || self.cursors.get(&pipeline).is_none_or(|c| c.next != at) {
                let epochs = self.data.open(&InputContext { first_step: at.1, ..*ctx }, self.span)?;
                self.cursors.insert(pipeline, Cursor { next: at, epochs, recent: Vec::new() });
            }
            let c = self.cursors.get_mut(&pipeline).expect("just positioned");
            let next = c.epochs.next_batch()?;
            match next {
                Some(b) if (b.epoch, b.step) == at => return self.to_device(b),
                Some(b) => return Err(TrainError::OutOfStep { got: (b.epoch, b.step), asked: at }),
                None if !reopened => continue,
                None => break,
            }
        }
        Err(TrainError::NoSteps { batch_size: ctx.per_replica_batch_size, workers: ctx.num_input_pipelines as usize })
    }

    fn to_device(&self, b: Batch) -> Result<Batch, TrainError> {
        let columns = b.columns.map(|t| to_device(t.shallow_clone(), self.device))?;
        Ok(Batch { columns, ..b })
    }
}

/// Another reference to the same batch.
fn shallow(b: &Batch) -> Batch {
    Batch { epoch: b.epoch, step: b.step, columns: b.columns.shallow_clone(), ids: b.ids.clone() }
}

/// `t` on `device`; to a GPU from page-locked memory without waiting, so the copy queues behind
/// the step in flight instead of stalling the host.
fn to_device(t: Tensor, device: Device) -> Result<Tensor, TrainError> {
    let moved = match device {
        // `_pin_memory`: see `collective::buckets`.
        Device::Cuda(_) => t.f_internal_pin_memory(device).and_then(|p| p.f_to_device_(device, p.kind(), true, false)),
        _ => t.f_to_device(device),
    };
    moved.map_err(|source| TrainError::Torch { what: "moving the batch to the device", source })
}
