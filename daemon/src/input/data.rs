//! A run's data with its model: both splits loaded (through the plugin, or the columnar
//! dataset's readers), the steps of an epoch, and batches in order from any (epoch, step) on.

use std::sync::Arc;

use trainerd_data::text::BlockStream;
use trainerd_data::{Plan, Shuffle, Slice, Stream};
use trainerd_sdk::{InputContext, Split};

use super::text::Text;
use super::{DataSource, Files, InputError};
use crate::plugin::{self, InputPipeline, ModelInstance};

/// One batch: this worker's slice of a global batch.
pub(crate) struct Batch {
    /// Its epoch.
    pub(crate) epoch: u32,
    /// Its step (from 0).
    pub(crate) step: u64,
    /// Its columns.
    pub(crate) columns: trainerd_sdk::Batch,
    /// Its examples' ids, when the data has them (a columnar dataset).
    pub(crate) ids: Option<Vec<ExampleId>>,
}

/// An example's id in its split, as `--log-examples` writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExampleId {
    /// A row of a Parquet dataset: (file index in name order, row in the file), written `[f, r]`.
    Row(u32, u64),
    /// A block of packed text, written `["block", b]`.
    Block(u64),
}

impl serde::Serialize for ExampleId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(2)?;
        match *self {
            ExampleId::Row(file, row) => {
                t.serialize_element(&file)?;
                t.serialize_element(&row)?;
            }
            ExampleId::Block(b) => {
                t.serialize_element("block")?;
                t.serialize_element(&b)?;
            }
        }
        t.end()
    }
}

/// A run's data, with its model.
pub(crate) enum Data<'m> {
    /// Read by the plugin.
    Plugin {
        /// The training split.
        train: plugin::Dataset<'m>,
        /// The test split, when the run evaluates.
        test: Option<plugin::Dataset<'m>>,
    },
    /// Read by trainerd.
    Files(Arc<Files>),
    /// Raw text, packed by trainerd.
    Text(Arc<Text>),
}

impl<'m> Data<'m> {
    /// The data `source` names, for `model`.
    pub(crate) fn load(source: &DataSource, model: &'m ModelInstance<'m>) -> Result<Data<'m>, InputError> {
        Ok(match source {
            DataSource::Plugin(dir, evaluate) => {
                let test = evaluate.then(|| model.load_data(dir, Split::Test)).transpose()?;
                Data::Plugin { train: model.load_data(dir, Split::Train)?, test }
            }
            DataSource::Files(files) => Data::Files(Arc::clone(files)),
            DataSource::Text(text) => Data::Text(Arc::clone(text)),
        })
    }

    /// Steps in an epoch of the training split for `ctx`'s slice.
    pub(crate) fn steps(&self, ctx: &InputContext) -> Result<u64, InputError> {
        match self {
            Data::Plugin { train, .. } => Ok(train.pipeline(ctx)?.steps()),
            Data::Files(f) => Ok(slice(ctx).steps(f.train.rows())),
            Data::Text(t) => Ok(slice(ctx).steps(t.train.count())),
        }
    }

    /// Batches of `ctx` (its split by `ctx.training`) from `(ctx.epoch, ctx.first_step)` on:
    /// to the end of that epoch, or (a columnar dataset's training) through epoch `end_epoch - 1`,
    /// `steps_per_epoch` steps each.
    pub(crate) fn open(
        &self,
        ctx: &InputContext,
        (end_epoch, steps_per_epoch): (u32, u64),
    ) -> Result<Epochs<'_>, InputError> {
        if !ctx.training {
            return Ok(self.in_order(ctx, Split::Test)?.0);
        }
        match self {
            Data::Plugin { train, .. } => {
                let pipeline = train.pipeline(ctx)?;
                let steps = pipeline.steps().min(steps_per_epoch);
                Ok(Epochs::Plugin { pipeline, epoch: ctx.epoch as u32, next: ctx.first_step, steps })
            }
            Data::Files(f) => {
                let shuffle = Some(Shuffle { seed: ctx.seed, window: f.window });
                let plan = Plan {
                    slice: slice(ctx),
                    shuffle,
                    first: (ctx.epoch as u32, ctx.first_step),
                    end_epoch,
                    steps_per_epoch,
                };
                Ok(Epochs::Files(f.train.open(plan)))
            }
            Data::Text(t) => {
                let shuffle = Some(Shuffle { seed: ctx.seed, window: u64::MAX });
                let first = (ctx.epoch as u32, ctx.first_step);
                let plan = Plan { slice: slice(ctx), shuffle, first, end_epoch, steps_per_epoch };
                Ok(Epochs::Text(t.train.open(plan)))
            }
        }
    }
}

impl Data<'_> {
    /// Every example of `split` once, in order, `ctx`'s share of each global batch, from
    /// `ctx.first_step` on, and how many batches the whole pass has: what evaluation reads of the
    /// test split and `trainerd predict` of either.
    pub(crate) fn in_order(&self, ctx: &InputContext, split: Split) -> Result<(Epochs<'_>, u64), InputError> {
        let ctx = InputContext { training: false, ..*ctx };
        match self {
            Data::Plugin { train, test } => {
                let data = match split {
                    Split::Train => Some(train),
                    Split::Test => test.as_ref(),
                };
                let pipeline = data.ok_or(InputError::NoEvaluation)?.pipeline(&ctx)?;
                let steps = pipeline.steps();
                Ok((Epochs::Plugin { pipeline, epoch: ctx.epoch as u32, next: ctx.first_step, steps }, steps))
            }
            Data::Files(f) => {
                let reader = reader(f, split)?;
                let slice = slice(&ctx);
                let (first, end_epoch, steps) =
                    ((ctx.epoch as u32, ctx.first_step), ctx.epoch as u32 + 1, slice.steps(reader.rows()));
                let plan = Plan { slice, shuffle: None, first, end_epoch, steps_per_epoch: steps };
                Ok((Epochs::Files(reader.open(plan)), steps))
            }
            Data::Text(t) => {
                let blocks = match split {
                    Split::Train => &t.train,
                    Split::Test => t.test.as_ref().ok_or(InputError::NoEvaluation)?,
                };
                let slice = slice(&ctx);
                let steps = slice.steps(blocks.count());
                let plan = Plan {
                    slice,
                    shuffle: None,
                    first: (ctx.epoch as u32, ctx.first_step),
                    end_epoch: ctx.epoch as u32 + 1,
                    steps_per_epoch: steps,
                };
                Ok((Epochs::Text(blocks.open(plan)), steps))
            }
        }
    }

    /// The number of each example of `batch` (read by [`Data::in_order`] for `ctx`) in its split:
    /// files in name order and rows in file order, or the position in the plugin's own data.
    pub(crate) fn example_numbers(
        &self,
        batch: &Batch,
        ctx: &InputContext,
        split: Split,
    ) -> Result<Vec<i64>, InputError> {
        match (self, &batch.ids) {
            (Data::Files(f), Some(ids)) => {
                let reader = reader(f, split)?;
                let number = |id: &ExampleId| match *id {
                    ExampleId::Row(file, row) => reader.example_number((file, row)) as i64,
                    ExampleId::Block(b) => b as i64,
                };
                Ok(ids.iter().map(number).collect())
            }
            (Data::Text(_), Some(ids)) => Ok(ids
                .iter()
                .map(|id| match *id {
                    ExampleId::Block(b) => b as i64,
                    ExampleId::Row(_, row) => row as i64,
                })
                .collect()),
            _ => {
                // The SDK's evaluation sharding: step s holds positions s*G.. of the split, this
                // pipeline the slice at its index.
                let local = u64::from(ctx.per_replica_batch_size);
                let first = batch.step * ctx.global_batch_size() + u64::from(ctx.input_pipeline_id) * local;
                Ok((0..batch.columns.examples()).map(|j| (first + j as u64) as i64).collect())
            }
        }
    }
}

/// The reader of `split`.
fn reader(f: &Files, split: Split) -> Result<&trainerd_data::Reader, InputError> {
    match split {
        Split::Train => Ok(&f.train),
        Split::Test => f.test.as_ref().ok_or(InputError::NoEvaluation),
    }
}

fn slice(ctx: &InputContext) -> Slice {
    Slice {
        rank: u64::from(ctx.input_pipeline_id),
        workers: u64::from(ctx.num_input_pipelines),
        batch: u64::from(ctx.per_replica_batch_size),
        training: ctx.training,
    }
}

/// Batches in order, from where they were opened.
pub(crate) enum Epochs<'d> {
    /// One epoch of a plugin's pipeline.
    Plugin {
        /// The pipeline.
        pipeline: InputPipeline<'d>,
        /// Its epoch.
        epoch: u32,
        /// The step of its next batch.
        next: u64,
        /// Its last step + 1.
        steps: u64,
    },
    /// A columnar dataset's stream.
    Files(Stream),
    /// Packed text's blocks.
    Text(BlockStream),
}

impl Epochs<'_> {
    /// The next batch, or `None` at the end.
    pub(crate) fn next_batch(&mut self) -> Result<Option<Batch>, InputError> {
        match self {
            Epochs::Plugin { pipeline, epoch, next, steps } => {
                if *next >= *steps {
                    return Ok(None);
                }
                let Some(columns) = pipeline.next_batch()? else { return Ok(None) };
                *next += 1;
                Ok(Some(Batch { epoch: *epoch, step: *next - 1, columns, ids: None }))
            }
            Epochs::Files(stream) => Ok(stream.next_batch()?.map(|b| Batch {
                epoch: b.epoch,
                step: b.step,
                columns: b.columns,
                ids: Some(b.ids.into_iter().map(|(file, row)| ExampleId::Row(file, row)).collect()),
            })),
            Epochs::Text(stream) => Ok(stream.next_batch()?.map(|b| Batch {
                epoch: b.epoch,
                step: b.step,
                columns: b.columns,
                ids: Some(b.blocks.into_iter().map(ExampleId::Block).collect()),
            })),
        }
    }
}
