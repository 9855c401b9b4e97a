//! The training split's batches, by (epoch, step): each epoch's input pipeline, positioned at a
//! step (a resumed or recovered run starts mid-epoch), with the last two batches kept on the
//! device: the step in flight's, which a step abandoned and taken again needs again, and the
//! next one, made while the device computes the current step.

use tch::{Device, Tensor};
use trainerd_sdk::InputContext;

use super::TrainError;
use crate::plugin::{Dataset, InputPipeline};

/// The input context of worker `rank` of `world`, each taking `batch_size` examples of every
/// global batch, in `epoch` of a run seeded `seed`.
pub fn input_context(
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

/// An epoch's input pipeline, positioned at a step, keeping the last two batches it handed out
/// (already on the device): the step in flight's, which a step abandoned and taken again needs
/// again, and the next one, taken while the device computes the current step.
struct Cursor<'d> {
    epoch: u32,
    next: u64,
    pipeline: InputPipeline<'d>,
    recent: Vec<(u64, Tensor, Tensor)>,
}

/// Batches `(epoch, step)` (0-based step) from `data`, on `device`, reopening the pipeline only
/// when it is not positioned there.
pub struct Batches<'d> {
    data: &'d Dataset<'d>,
    device: Device,
    cursor: Option<Cursor<'d>>,
}

impl<'d> Batches<'d> {
    /// Batches of `data` on `device`.
    pub fn new(data: &'d Dataset<'d>, device: Device) -> Batches<'d> {
        Batches { data, device, cursor: None }
    }

    /// The batch of step `step` (0-based) of `ctx`'s epoch.
    pub fn get(&mut self, ctx: &InputContext, step: u64) -> Result<(Tensor, Tensor), TrainError> {
        let epoch = ctx.epoch as u32;
        if let Some(c) = self.cursor.as_ref().filter(|c| c.epoch == epoch) {
            if let Some((_, xs, ys)) = c.recent.iter().find(|(s, ..)| *s == step) {
                return Ok((xs.shallow_clone(), ys.shallow_clone()));
            }
        }
        if !self.cursor.as_ref().is_some_and(|c| c.epoch == epoch && c.next == step) {
            // Opened at the step: the batches before it are not made.
            let pipeline = self.data.pipeline(&InputContext { first_step: step, ..*ctx })?;
            self.cursor = Some(Cursor { epoch, next: step, pipeline, recent: Vec::new() });
        }
        let c = self.cursor.as_mut().expect("positioned");
        let next = match c.pipeline.next_batch() {
            Ok(next) => next,
            Err(e) => {
                // A pipeline that failed is not trusted to go on: the next request starts afresh
                // (and meets the same error, if a prefetch swallowed it).
                self.cursor = None;
                return Err(e.into());
            }
        };
        let (xs, ys) = next.ok_or(TrainError::NoSteps {
            batch_size: ctx.per_replica_batch_size,
            workers: ctx.num_input_pipelines as usize,
        })?;
        let (xs, ys) = (to_device(xs, self.device)?, to_device(ys, self.device)?);
        c.next = step + 1;
        if c.recent.len() == 2 {
            let _ = c.recent.remove(0);
        }
        c.recent.push((step, xs.shallow_clone(), ys.shallow_clone()));
        Ok((xs, ys))
    }
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
