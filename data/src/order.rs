//! The order of a split in an epoch, as a pure function of (seed, epoch, the split's row groups,
//! the shuffle window): no I/O, no worker count, no cache size. Every worker computes it alone
//! and they agree; a resumed or recovered pipeline opens at any (epoch, step) without replaying
//! anything; N workers with batch b see exactly what one worker with batch N·b sees.
//!
//! **Training** (shuffle quality, as MosaicML's docs state theirs):
//! - With a window of at least the split's rows, the order is a uniform random permutation of
//!   the rows ([`trainerd_sdk::data::epoch_permutation`], the in-memory path's order: a Parquet
//!   copy of an idx dataset trains bit for bit as the idx files do).
//! - Otherwise, two levels. The row groups (of every file together, so shards are shuffled too)
//!   are put in a random order, making a stream of rows; the stream is cut into consecutive
//!   windows of `window` rows, and each window is permuted uniformly. An example lands anywhere
//!   within its window; two examples of one row group stay within one or two windows of each
//!   other; every row group is read once per window it spans.
//! - Every random draw comes from ChaCha8 keyed by (seed, epoch, what is drawn), so no
//!   dependency upgrade and no other setting changes it.
//!
//! **Evaluation** reads the rows in file order.
//!
//! Positions: step `s` of an epoch covers positions `s·G .. (s+1)·G` (`G` the global batch), and
//! worker `i` takes the `i`-th slice of `b` of them, as TensorFlow's auto-shard by data does.
//! Training drops the last partial global batch; evaluation keeps every row once.

use trainerd_sdk::data::epoch_permutation;

/// A split's row groups, in file order: the row each starts at, and the split's rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The first row of each row group (ascending, from 0).
    pub starts: Vec<u64>,
    /// Rows in the split.
    pub rows: u64,
}

impl Layout {
    /// The layout of row groups of `sizes` rows each.
    pub fn of_sizes(sizes: &[u64]) -> Layout {
        let mut starts = Vec::with_capacity(sizes.len());
        let mut rows = 0;
        for &n in sizes {
            starts.push(rows);
            rows += n;
        }
        Layout { starts, rows }
    }

    /// Rows in row group `g`.
    pub fn size(&self, g: usize) -> u64 {
        self.starts.get(g + 1).copied().unwrap_or(self.rows) - self.starts[g]
    }

    /// The row group holding `row`.
    pub fn group_of(&self, row: u64) -> usize {
        self.starts.partition_point(|&s| s <= row) - 1
    }
}

/// How training shuffles: the run's seed and the window, in rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shuffle {
    /// The run's seed.
    pub seed: u64,
    /// Rows permuted together (see the module's documentation).
    pub window: u64,
}

/// One epoch's order: the row at each position.
#[derive(Debug)]
pub struct EpochOrder {
    rows: u64,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// Evaluation: file order.
    Identity,
    /// One window over the whole split: a uniform permutation.
    Full(Vec<i64>),
    /// Row groups shuffled, then windows.
    Windowed(Windowed),
}

#[derive(Debug)]
struct Windowed {
    seed: u64,
    epoch: u64,
    window: u64,
    /// Row groups in stream order, and where each starts: in the split, and in the stream.
    groups: Vec<(u64, u64, u64)>,
    /// The last window's permutation, by window index.
    cached: Option<(u64, Vec<i64>)>,
}

/// What a draw is for, mixed into its key so that no two draws share a stream.
const ROW_GROUPS: u64 = 0x7267_5f6f_7264_6572;
const WINDOW: u64 = 0x7769_6e64_6f77_5f70;

/// SplitMix64 of (seed, what, index): a ChaCha8 seed per draw.
fn key(seed: u64, what: u64, index: u64) -> u64 {
    let mut z = seed ^ what ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl EpochOrder {
    /// Training's order in `epoch`.
    pub fn training(layout: &Layout, shuffle: Shuffle, epoch: u64) -> EpochOrder {
        let rows = layout.rows;
        if shuffle.window >= rows {
            return EpochOrder { rows, kind: Kind::Full(epoch_permutation(rows as usize, shuffle.seed, epoch)) };
        }
        let order = epoch_permutation(layout.starts.len(), key(shuffle.seed, ROW_GROUPS, 0), epoch);
        let mut at = 0;
        let groups = order
            .into_iter()
            .map(|g| {
                let g = g as usize;
                let entry = (layout.starts[g], layout.size(g), at);
                at += layout.size(g);
                entry
            })
            .collect();
        let windowed = Windowed { seed: shuffle.seed, epoch, window: shuffle.window.max(1), groups, cached: None };
        EpochOrder { rows, kind: Kind::Windowed(windowed) }
    }

    /// Evaluation's order: the rows as the files hold them.
    pub fn evaluation(rows: u64) -> EpochOrder {
        EpochOrder { rows, kind: Kind::Identity }
    }

    /// Rows in the split.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Positions permuted together: the order's windows (the whole split when it has one).
    pub fn window(&self) -> u64 {
        match &self.kind {
            Kind::Windowed(w) => w.window,
            _ => self.rows.max(1),
        }
    }

    /// The row at `position` (below the split's rows).
    pub fn row(&mut self, position: u64) -> u64 {
        debug_assert!(position < self.rows);
        match &mut self.kind {
            Kind::Identity => position,
            Kind::Full(perm) => perm[position as usize] as u64,
            Kind::Windowed(w) => w.row(position, self.rows),
        }
    }

    /// The row group where window `w`'s stream ends inside (it continues into the next window),
    /// as a row: `None` when the window ends at a row group's end.
    pub fn straddling(&self, w: u64) -> Option<u64> {
        let Kind::Windowed(win) = &self.kind else { return None };
        let end = (w + 1) * win.window;
        if end >= self.rows {
            return None;
        }
        let i = win.groups.partition_point(|&(_, _, at)| at < end);
        let (start, _, at) = win.groups[i - 1];
        (win.groups.get(i).is_none_or(|&(_, _, next)| next > end)).then_some(start + (end - 1 - at))
    }
}

impl Windowed {
    fn row(&mut self, position: u64, rows: u64) -> u64 {
        let w = position / self.window;
        if self.cached.as_ref().is_none_or(|(cached, _)| *cached != w) {
            let len = self.window.min(rows - w * self.window);
            self.cached = Some((w, epoch_permutation(len as usize, key(self.seed, WINDOW, w), self.epoch)));
        }
        let perm = &self.cached.as_ref().expect("just made").1;
        let q = w * self.window + perm[(position % self.window) as usize] as u64;
        let i = self.groups.partition_point(|&(_, _, at)| at <= q) - 1;
        let (start, _, at) = self.groups[i];
        start + (q - at)
    }
}

/// Where worker `rank` of `workers`, each taking `batch` rows of every global batch, stands in
/// an epoch of `rows` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slice {
    /// This worker's rank.
    pub rank: u64,
    /// Workers.
    pub workers: u64,
    /// Rows per worker per step.
    pub batch: u64,
    /// Training (drops the last partial global batch) or evaluation (keeps every row).
    pub training: bool,
}

impl Slice {
    /// Rows per step over all workers.
    pub fn global(&self) -> u64 {
        self.batch * self.workers
    }

    /// Steps in an epoch of `rows` rows.
    pub fn steps(&self, rows: u64) -> u64 {
        let g = self.global();
        if g == 0 {
            0
        } else if self.training {
            rows / g
        } else {
            rows.div_ceil(g)
        }
    }

    /// The positions this worker takes at `step` (empty or short only at evaluation's end).
    pub fn positions(&self, step: u64, rows: u64) -> std::ops::Range<u64> {
        let start = (step * self.global() + self.rank * self.batch).min(rows);
        start..(start + self.batch).min(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all(order: &mut EpochOrder) -> Vec<u64> {
        (0..order.rows()).map(|p| order.row(p)).collect()
    }

    #[test]
    fn a_window_over_the_split_is_the_in_memory_order() {
        let layout = Layout::of_sizes(&[100, 100, 37]);
        let mut order = EpochOrder::training(&layout, Shuffle { seed: 5, window: 1 << 20 }, 2);
        let expected: Vec<u64> = epoch_permutation(237, 5, 2).into_iter().map(|r| r as u64).collect();
        assert_eq!(all(&mut order), expected);
    }

    /// Pinned: a change here silently changes every windowed run's data order.
    #[test]
    fn the_windowed_order_is_pinned() {
        let layout = Layout::of_sizes(&[3, 3, 3, 3]);
        let mut order = EpochOrder::training(&layout, Shuffle { seed: 3, window: 4 }, 0);
        // The stream is row groups 1, 3, 2, 0 (rows 3-5, 9-11, 6-8, 0-2); each window of 4 is
        // permuted within itself.
        assert_eq!(all(&mut order), [3, 5, 9, 4, 11, 10, 7, 6, 2, 1, 8, 0]);
    }

    #[test]
    fn the_row_group_holding_a_row_is_found() {
        let layout = Layout::of_sizes(&[3, 0, 4, 1]);
        let groups: Vec<usize> = (0..8).map(|r| layout.group_of(r)).collect();
        assert_eq!(groups, [0, 0, 0, 2, 2, 2, 2, 3]);
        assert_eq!(layout.size(1), 0);
    }

    #[test]
    fn a_window_straddles_the_row_group_its_stream_ends_inside() {
        let layout = Layout::of_sizes(&[3, 3, 3, 3]);
        let order = EpochOrder::training(&layout, Shuffle { seed: 3, window: 4 }, 0);
        // Stream: row groups 1, 3, 2, 0 in this epoch (rows 3-5, 9-11, 6-8, 0-2).
        assert_eq!(order.straddling(0), Some(9), "window 0 ends after the first row of group 3");
        assert_eq!(order.straddling(1), Some(7), "window 1 ends after the second row of group 2");
        assert_eq!(order.straddling(2), None, "the last window ends with the split");
        let aligned = EpochOrder::training(&layout, Shuffle { seed: 3, window: 6 }, 0);
        assert_eq!(aligned.straddling(0), None, "window 0 ends with a row group");
    }

    proptest! {
        /// Every order is a permutation of the rows, whatever the window, and each window's rows
        /// are the row groups its stream covers.
        #[test]
        fn every_epoch_is_a_permutation(
            sizes in proptest::collection::vec(0u64..40, 1..12),
            window in 1u64..200,
            seed: u64,
            epoch in 0u64..4,
        ) {
            let layout = Layout::of_sizes(&sizes);
            let mut order = EpochOrder::training(&layout, Shuffle { seed, window }, epoch);
            let mut rows = all(&mut order);
            rows.sort_unstable();
            prop_assert_eq!(rows, (0..layout.rows).collect::<Vec<_>>());
        }

        /// The row at a position does not depend on which positions were asked before (a
        /// pipeline opened at any step agrees with one that ran from the start).
        #[test]
        fn any_position_is_reached_directly(
            sizes in proptest::collection::vec(1u64..40, 1..12),
            window in 1u64..100,
            at in 0usize..400,
        ) {
            let layout = Layout::of_sizes(&sizes);
            let shuffle = Shuffle { seed: 9, window };
            let whole = all(&mut EpochOrder::training(&layout, shuffle, 1));
            let at = at % whole.len();
            let mut fresh = EpochOrder::training(&layout, shuffle, 1);
            prop_assert_eq!(fresh.row(at as u64), whole[at]);
        }

        /// N workers with batch b take, step by step, exactly one worker's batch N·b, in
        /// training and in evaluation.
        #[test]
        fn worker_slices_concatenate_to_the_global_batch(rows in 0u64..300, workers in 1u64..6, batch in 1u64..9, training: bool) {
            let one = Slice { rank: 0, workers: 1, batch: batch * workers, training };
            let steps = one.steps(rows);
            for step in 0..steps {
                let joined: Vec<u64> = (0..workers)
                    .flat_map(|rank| Slice { rank, workers, batch, training }.positions(step, rows))
                    .collect();
                prop_assert_eq!(joined, one.positions(step, rows).collect::<Vec<_>>());
                prop_assert_eq!(Slice { rank: 0, workers, batch, training }.steps(rows), steps);
            }
        }
    }
}
