//! The blocks of a packed split, batch by batch: block `b` is tokens `b·L .. (b+1)·L` of the
//! split's token stream. Training's order is a uniform shuffle of the blocks, a pure function of
//! (seed, epoch) ([`crate::order`]), so a resumed or recovered worker opens at any (epoch, step)
//! and N workers of batch b see what one worker of batch N·b sees; evaluation reads the blocks in
//! order. Each batch reads its blocks from the token file (positioned reads: nothing else of the
//! file is held in memory), which stays held in the data cache for as long as the blocks live.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use trainerd_sdk::tch::Tensor;

use super::pack::{Counts, TokenFile};
use super::TextError;
use crate::cache::InUse;
use crate::error::DataError;
use crate::order::{EpochOrder, Layout, Shuffle};
use crate::stream::Plan;

/// The name of the column that holds a block's ids again, as labels (Hugging Face's).
pub const LABELS: &str = "labels";

/// A packed split: its token file cut into blocks.
#[derive(Debug)]
pub struct Blocks {
    file: InUse,
    path: PathBuf,
    /// What the pass found.
    pub counts: Counts,
    /// Tokens per block.
    pub length: u32,
    /// The batch's column of the ids.
    pub column: String,
    /// Whether this run tokenized the split (else it read an earlier run's pass again).
    pub made: bool,
}

/// One batch of blocks: this worker's slice of a global batch.
pub struct BlockBatch {
    /// Its epoch.
    pub epoch: u32,
    /// Its step in the epoch (from 0).
    pub step: u64,
    /// `column` (int64 `[blocks, length]`) and [`LABELS`], the same tensor.
    pub columns: trainerd_sdk::Batch,
    /// Each example's block.
    pub blocks: Vec<u64>,
}

impl Blocks {
    /// The blocks of `length` tokens of `tokens`, as column `column`; an error naming the split
    /// when it has fewer tokens than one block.
    pub fn new(
        tokens: TokenFile,
        length: u32,
        column: &str,
        (split, location): (&str, &str),
    ) -> Result<Blocks, DataError> {
        let TokenFile { path, counts, made, held } = tokens;
        if counts.tokens < u64::from(length) {
            return Err(TextError::TooFew {
                split: split.to_string(),
                location: location.to_string(),
                tokens: counts.tokens,
                documents: counts.documents,
                length,
            }
            .into());
        }
        Ok(Blocks { file: held, path, counts, length, column: column.to_string(), made })
    }

    /// Blocks in the split (the last partial one dropped).
    pub fn count(&self) -> u64 {
        self.counts.tokens / u64::from(self.length)
    }

    /// Block `b`'s ids.
    pub fn block(&self, b: u64) -> Result<Vec<i64>, DataError> {
        let n = self.length as usize;
        let mut bytes = vec![0u8; n * 4];
        let at = b * u64::from(self.length) * 4;
        let read = self.file.file().read_exact_at(&mut bytes, at);
        read.map_err(|source| TextError::Cache { path: self.path.display().to_string(), source })?;
        Ok(bytes.chunks_exact(4).map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect())
    }

    /// The batches of `plan` (its shuffle's window does not apply: every training epoch is a
    /// uniform shuffle of the blocks).
    pub fn open(self: &Arc<Blocks>, plan: Plan) -> BlockStream {
        BlockStream { blocks: Arc::clone(self), plan, next: plan.first, order: None }
    }
}

/// Batches of blocks in order, from where they were opened.
pub struct BlockStream {
    blocks: Arc<Blocks>,
    plan: Plan,
    /// The next batch's (epoch, step).
    next: (u32, u64),
    order: Option<(u32, EpochOrder)>,
}

impl BlockStream {
    /// The next batch, or `None` after the plan's last.
    pub fn next_batch(&mut self) -> Result<Option<BlockBatch>, DataError> {
        let count = self.blocks.count();
        let steps = self.plan.slice.steps(count).min(self.plan.steps_per_epoch);
        if self.next.1 >= steps {
            self.next = (self.next.0 + 1, 0);
        }
        let (epoch, step) = self.next;
        if epoch >= self.plan.end_epoch || step >= steps {
            return Ok(None);
        }
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let order = match self.plan.shuffle {
                Some(Shuffle { seed, .. }) => {
                    EpochOrder::training(&Layout::of_sizes(&[count]), Shuffle { seed, window: count }, u64::from(epoch))
                }
                None => EpochOrder::evaluation(count),
            };
            self.order = Some((epoch, order));
        }
        let order = &mut self.order.as_mut().expect("made above").1;
        let blocks: Vec<u64> = self.plan.slice.positions(step, count).map(|p| order.row(p)).collect();
        let mut ids = Vec::with_capacity(blocks.len() * self.blocks.length as usize);
        for &b in &blocks {
            ids.extend(self.blocks.block(b)?);
        }
        let tensor = Tensor::from_slice(&ids).view([blocks.len() as i64, i64::from(self.blocks.length)]);
        let columns =
            trainerd_sdk::Batch::new().with(self.blocks.column.clone(), tensor.shallow_clone()).with(LABELS, tensor);
        self.next = (epoch, step + 1);
        Ok(Some(BlockBatch { epoch, step, columns, blocks }))
    }
}
