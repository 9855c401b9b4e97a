//! The input pipeline over one split: batches from a step on, made ahead of the training step on
//! background threads, in bounded memory.
//!
//! Two threads coordinate the loader pool:
//! - the **planner** walks the epochs' windows ([`crate::order`]) from the first step, works out
//!   which rows this worker takes in each window, and reads their row groups on the pool, in the
//!   order the steps first need them, keeping only this worker's rows (still encoded);
//! - the **assembler** makes the batches in step order as soon as their rows are in, decoding
//!   images on the pool, and hands them over through a queue of [`DEPTH`] batches.
//!
//! Memory: the rows held (read and not yet batched) stay under a budget of two windows' worth of
//! this worker's rows plus two row groups, so the next window is read while the current one is
//! trained on; a row group needed by the step the assembler waits for is read whatever the
//! budget, so the pipeline never deadlocks. The row group a window's stream ends inside is kept
//! (its bytes) for the next window, so every row group is read once per epoch and worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use trainerd_sdk::{Columns, Split};

use crate::batch::{padding_mask, stack};
use crate::error::{caught, DataError, GroupError, ValueError};
use crate::index::SplitIndex;
use crate::order::{EpochOrder, Shuffle, Slice};
use crate::rows::{self, Chunk, Place, Row, Value};
use crate::schema::Projection;
use crate::source::{Purpose, Source};

/// Batches made ahead of the one the step takes.
pub const DEPTH: usize = 3;

/// One batch: this worker's slice of a global batch.
pub struct Batch {
    /// Its epoch.
    pub epoch: u32,
    /// Its step in the epoch (from 0).
    pub step: u64,
    /// Its columns, each `[rows, ...]` (CPU), named as declared, and the derived padding mask of
    /// token columns ([`trainerd_sdk::Columns::masked_tokens`]).
    pub columns: trainerd_sdk::Batch,
    /// Each row's example id: (file index in sorted order, row in the file).
    pub ids: Vec<(u32, u64)>,
}

/// What a stream yields: which slice, which order, from where, to where.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// This worker's slice of every global batch.
    pub slice: Slice,
    /// Training's shuffle; `None` for evaluation (file order).
    pub shuffle: Option<Shuffle>,
    /// The first batch: (epoch, step).
    pub first: (u32, u64),
    /// The epoch after the last one.
    pub end_epoch: u32,
    /// Steps in each epoch (at most the split's).
    pub steps_per_epoch: u64,
}

/// What every stream over a split shares.
pub(crate) struct Input {
    pub source: Arc<Source>,
    pub split: Arc<SplitIndex>,
    pub projections: Vec<Projection>,
    pub columns: Columns,
    pub pool: Arc<rayon::ThreadPool>,
    pub peak_bytes: Arc<AtomicUsize>,
}

struct Shared {
    held: Mutex<Held>,
    changed: Condvar,
    stop: AtomicBool,
}

#[derive(Default)]
struct Held {
    /// Rows read and not yet batched, by (epoch, row of the split): an epoch read ahead holds
    /// the same rows as the one being trained on.
    rows: HashMap<(u32, u64), Row>,
    bytes: usize,
    /// Rows being read.
    loading: usize,
    /// Reads on the pool.
    in_flight: usize,
    /// Each planned step's rows by slot (filled as the windows it spans are planned).
    plans: BTreeMap<(u32, u64), Vec<Option<u64>>>,
    /// The step the assembler waits for.
    consuming: (u32, u64),
    /// Straddling row groups' bytes, kept for the next window: (epoch, group, bytes). At most
    /// two: the one this window takes over, and the one it hands on.
    carry: Vec<(u32, usize, Bytes)>,
    error: Option<DataError>,
}

/// Batches from a split, made ahead on background threads.
pub struct Stream {
    rx: Option<Receiver<Result<Batch, DataError>>>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    patience: Duration,
}

impl Stream {
    pub(crate) fn open(input: Arc<Input>, plan: Plan, patience: Duration) -> Stream {
        let shared = Arc::new(Shared { held: Mutex::default(), changed: Condvar::new(), stop: AtomicBool::new(false) });
        shared.lock().consuming = plan.first;
        let (tx, rx) = std::sync::mpsc::sync_channel(DEPTH);
        let planner = {
            let (input, shared) = (Arc::clone(&input), Arc::clone(&shared));
            std::thread::Builder::new()
                .name("trainerd-data-plan".into())
                .spawn(move || {
                    crate::batch_scheduling();
                    Planner { input, shared, plan }.run()
                })
                .expect("a thread for the data planner")
        };
        let assembler = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("trainerd-data-batch".into())
                .spawn(move || {
                    crate::batch_scheduling();
                    assemble(&input, &shared, plan, &tx)
                })
                .expect("a thread for the data assembler")
        };
        Stream { rx: Some(rx), shared, threads: vec![planner, assembler], patience }
    }

    /// The next batch, or `None` after the plan's last.
    pub fn next_batch(&mut self) -> Result<Option<Batch>, DataError> {
        let rx = self.rx.as_ref().expect("open until dropped");
        match rx.recv_timeout(self.patience) {
            Ok(Ok(batch)) => Ok(Some(batch)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Disconnected) => Ok(None),
            Err(RecvTimeoutError::Timeout) => Err(DataError::Unavailable {
                file: "(the input pipeline)".into(),
                waited: self.patience,
                last: "no batch came".into(),
            }),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // The assembler may wait to hand over a batch: dropping the queue ends that wait.
        drop(self.rx.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'a>(&self, held: MutexGuard<'a, Held>) -> MutexGuard<'a, Held> {
        self.changed.wait(held).unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stopped(&self, held: &Held) -> bool {
        self.stop.load(Ordering::SeqCst) || held.error.is_some()
    }
}

/// The rows of one row group this worker takes in a window: which, and the first step needing
/// them.
struct Job {
    group: usize,
    /// Rows of the split, ascending.
    rows: Vec<u64>,
    first_step: u64,
}

struct Planner {
    input: Arc<Input>,
    shared: Arc<Shared>,
    plan: Plan,
}

impl Planner {
    fn run(self) {
        let (plan, split) = (self.plan, &self.input.split);
        let rows = split.rows();
        let g = plan.slice.global();
        let max_group = (0..split.layout.starts.len()).map(|i| split.layout.size(i)).max().unwrap_or(0);
        for epoch in plan.first.0..plan.end_epoch {
            let mut order = match plan.shuffle {
                Some(s) => EpochOrder::training(&split.layout, s, u64::from(epoch)),
                None => EpochOrder::evaluation(rows),
            };
            let chunk = match plan.shuffle {
                Some(_) => order.window(),
                None => (64 * g).max(4 * max_group).min(rows.max(1)),
            };
            let budget = 2 * chunk.div_ceil(plan.slice.workers) + 2 * max_group;
            let first_step = if epoch == plan.first.0 { plan.first.1 } else { 0 };
            let end = (plan.steps_per_epoch * g).min(rows);
            let start = (first_step * g).min(end);
            if start >= end {
                continue;
            }
            for w in start / chunk..=(end - 1) / chunk {
                let range = (w * chunk).max(start)..((w + 1) * chunk).min(end);
                let jobs = self.plan_window(epoch, range, &mut order);
                let keep = order.straddling(w).map(|row| split.layout.group_of(row));
                if !self.load(epoch, jobs, keep, budget as usize) {
                    return;
                }
            }
        }
    }

    /// Registers the slots of every step the worker's positions in `range` fall in; the row
    /// groups to read, by first use.
    fn plan_window(&self, epoch: u32, range: std::ops::Range<u64>, order: &mut EpochOrder) -> Vec<Job> {
        let (slice, split) = (self.plan.slice, &self.input.split);
        let rows = split.rows();
        let g = slice.global();
        let mut groups: BTreeMap<usize, Job> = BTreeMap::new();
        let mut pieces = Vec::new();
        for step in range.start / g..=(range.end - 1) / g {
            let mine = slice.positions(step, rows);
            for p in mine.start.max(range.start)..mine.end.min(range.end) {
                let row = order.row(p);
                pieces.push((step, (p - mine.start) as usize, row, mine.end - mine.start));
                let group = split.layout.group_of(row);
                let job = groups.entry(group).or_insert(Job { group, rows: Vec::new(), first_step: step });
                job.rows.push(row);
            }
        }
        {
            let mut held = self.shared.lock();
            for (step, slot, row, slots) in pieces {
                held.plans.entry((epoch, step)).or_insert_with(|| vec![None; slots as usize])[slot] = Some(row);
            }
        }
        self.shared.changed.notify_all();
        let mut jobs: Vec<Job> = groups.into_values().collect();
        for j in &mut jobs {
            j.rows.sort_unstable();
        }
        jobs.sort_by_key(|j| (j.first_step, j.group));
        jobs
    }

    /// Reads `jobs` on the pool, in order, within the row budget; `keep` is the row group whose
    /// bytes the next window needs too. False when the stream stops.
    fn load(&self, epoch: u32, jobs: Vec<Job>, keep: Option<usize>, budget: usize) -> bool {
        let threads = self.input.pool.current_num_threads().max(1);
        for job in jobs {
            let mut held = self.shared.lock();
            loop {
                if self.shared.stopped(&held) {
                    return false;
                }
                let needed_now = (epoch, job.first_step) <= held.consuming;
                // A row group larger than the whole budget is read when nothing else is held.
                let alone = held.loading == 0 && held.rows.is_empty();
                let room = held.rows.len() + held.loading + job.rows.len() <= budget || alone;
                if held.in_flight < threads && (room || needed_now) {
                    break;
                }
                held = self.shared.wait(held);
            }
            held.in_flight += 1;
            held.loading += job.rows.len();
            let carried = held.carry.iter().position(|(e, g, _)| (*e, *g) == (epoch, job.group));
            let carried = carried.map(|i| held.carry.swap_remove(i).2);
            drop(held);
            let (input, shared) = (Arc::clone(&self.input), Arc::clone(&self.shared));
            let keep = keep == Some(job.group);
            self.input.pool.spawn(move || read_job(&input, &shared, epoch, job, carried, keep));
        }
        // The next window may need the row group kept: let its read finish first.
        let mut held = self.shared.lock();
        while keep.is_some() && held.in_flight > 0 && !self.shared.stopped(&held) {
            held = self.shared.wait(held);
        }
        held.carry.retain(|(e, g, _)| *e == epoch && Some(*g) == keep);
        true
    }
}

/// Reads one row group's rows (on the pool) into the held rows.
fn read_job(input: &Input, shared: &Shared, epoch: u32, job: Job, carried: Option<Bytes>, keep: bool) {
    let split = &input.split;
    let group = split.groups[job.group];
    let file = &split.files[group.file];
    let start = split.layout.starts[job.group];
    let projection = &input.projections[group.file];
    let range = rows::byte_range(file.meta.metadata(), group.index, &projection.leaves);
    let read = || -> Result<(Vec<Row>, Bytes), DataError> {
        let bytes = match carried {
            Some(bytes) => bytes,
            None => {
                let purpose = if split.split == Split::Train { Purpose::Train(epoch) } else { Purpose::Test(epoch) };
                input.source.read(&file.file, range.clone(), purpose)?
            }
        };
        let chunk = Chunk { start: range.start, bytes: bytes.clone(), file_len: file.file.size };
        let shown = input.source.location().file(&file.file.name);
        let place = Place { file: &shown, group: group.index, first_row: group.first_row_in_file };
        let wanted: Vec<u64> = job.rows.iter().map(|r| r - start).collect();
        Ok((rows::read(place, &file.meta, chunk, (projection, &input.columns), &wanted)?, bytes))
    };
    let shown = || input.source.location().file(&file.file.name);
    let panicked = |p| DataError::RowGroup { file: shown(), row_group: group.index, reason: GroupError::Panicked(p) };
    let result = caught(panicked, read);
    let mut held = shared.lock();
    held.in_flight -= 1;
    held.loading -= job.rows.len();
    match result {
        Ok((rows, bytes)) => {
            for (r, row) in job.rows.iter().zip(rows) {
                held.bytes += row.size();
                held.rows.insert((epoch, *r), row);
            }
            input.peak_bytes.fetch_max(held.bytes, Ordering::Relaxed);
            if keep {
                held.carry.push((epoch, job.group, bytes));
            }
        }
        Err(e) => {
            held.error.get_or_insert(e);
        }
    }
    drop(held);
    shared.changed.notify_all();
}

/// Makes the plan's batches in step order and hands them over.
fn assemble(input: &Input, shared: &Shared, plan: Plan, tx: &SyncSender<Result<Batch, DataError>>) {
    let rows = input.split.rows();
    for epoch in plan.first.0..plan.end_epoch {
        let first = if epoch == plan.first.0 { plan.first.1 } else { 0 };
        for step in first..plan.steps_per_epoch {
            let slots = plan.slice.positions(step, rows).count();
            let taken = match take(shared, (epoch, step), slots) {
                Ok(Some(taken)) => taken,
                Ok(None) => return,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let location = input.source.location().to_string();
            let failed = |source| DataError::Panicked { location: location.clone(), source };
            let batch = input.pool.install(|| caught(failed, || make(input, epoch, step, taken)));
            let failed = batch.is_err();
            if tx.send(batch).is_err() || failed {
                return;
            }
        }
    }
}

/// The rows of `step`'s `slots` slots once they are all read; `None` when the stream stops.
fn take(shared: &Shared, step: (u32, u64), slots: usize) -> Result<Option<Vec<(u64, Row)>>, DataError> {
    let mut held = shared.lock();
    held.consuming = step;
    shared.changed.notify_all();
    if slots == 0 {
        return Ok(Some(Vec::new()));
    }
    loop {
        if let Some(e) = held.error.take() {
            return Err(e);
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let ready =
            held.plans.get(&step).filter(|p| p.iter().all(|s| s.is_some_and(|r| held.rows.contains_key(&(step.0, r)))));
        if let Some(plan) = ready {
            let ids: Vec<u64> = plan.iter().map(|s| s.expect("all slots planned")).collect();
            held.plans.remove(&step);
            let mut taken = Vec::with_capacity(ids.len());
            for r in ids {
                let row = held.rows.remove(&(step.0, r)).expect("present");
                held.bytes -= row.size();
                taken.push((r, row));
            }
            drop(held);
            shared.changed.notify_all();
            return Ok(Some(taken));
        }
        held = shared.wait(held);
    }
}

/// A batch's tensors from its rows.
fn make(input: &Input, epoch: u32, step: u64, taken: Vec<(u64, Row)>) -> Result<Batch, DataError> {
    let split = &input.split;
    let named = |i: usize, column: &str, reason: ValueError| {
        let r = taken[i].0;
        let group = split.groups[split.layout.group_of(r)];
        let (file, row) = split.example_id(r);
        DataError::Row {
            file: input.source.location().file(&split.files[file as usize].file.name),
            row_group: group.index,
            row,
            column: column.to_string(),
            reason: Box::new(reason),
        }
    };
    let mut columns = trainerd_sdk::Batch::new();
    for (k, c) in input.columns.iter().enumerate() {
        let values: Vec<&Value> = taken.iter().map(|(_, row)| &row.values[k]).collect();
        columns.push(c.name.clone(), stack(&values, c).map_err(|(i, e)| named(i, &c.name, e))?);
        if input.columns.masked_tokens().is_some_and(|m| m.name == c.name) {
            let mask = padding_mask(&values, &c.decode).map_err(|(i, e)| named(i, &c.name, e))?;
            columns.push(trainerd_sdk::ATTENTION_MASK, mask);
        }
    }
    let ids = taken.iter().map(|(r, _)| split.example_id(*r)).collect();
    Ok(Batch { epoch, step, columns, ids })
}
