//! The pipeline over real Parquet files (written by `convert` from a small MNIST-format
//! dataset): the same batches as the idx loader, the order's promises, the bytes each worker
//! reads, and every failure named.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use trainerd_data::convert::{self, Sharding};
use trainerd_data::{Batch, DataLocation, Dataset, Options, Plan, Purpose, Quiet, Shuffle, Slice};
use trainerd_sdk::mnist::{write_idx, Mnist, IMAGES_MAGIC, LABELS_MAGIC};
use trainerd_sdk::tch::Tensor;
use trainerd_sdk::{Columns, InputContext, Split};
use trainerd_storage::S3Options;

const TRAIN: u32 = 1000;
const TEST: u32 = 210;

/// A small MNIST-format dataset (noise images, labels 0-9) and its Parquet copy: 4 train files
/// of up to 300 rows in row groups of 50.
fn dataset(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let idx = dir.join("idx");
    std::fs::create_dir_all(&idx).unwrap();
    let mut x = 12345u64;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect()
    };
    for (prefix, n) in [("train", TRAIN), ("t10k", TEST)] {
        write_idx(
            &idx.join(format!("{prefix}-images-idx3-ubyte.gz")),
            IMAGES_MAGIC,
            &[n, 28, 28],
            &noise(n as usize * 784),
        )
        .unwrap();
        let labels: Vec<u8> = noise(n as usize).iter().map(|b| b % 10).collect();
        write_idx(&idx.join(format!("{prefix}-labels-idx1-ubyte.gz")), LABELS_MAGIC, &[n], &labels).unwrap();
    }
    let parquet = dir.join("parquet");
    let sharding = Sharding { rows_per_file: 300, rows_per_group: 50 };
    convert::mnist(&idx, &DataLocation::Local(parquet.clone()), &S3Options::default(), sharding, &mut |_, _, _| {})
        .unwrap();
    (idx, parquet)
}

fn open(dir: &Path) -> Dataset {
    let options = Options {
        s3: S3Options::default(),
        timeout: Duration::from_secs(5),
        cache: None,
        threads: 2,
        observer: Arc::new(Quiet),
    };
    Dataset::open(&DataLocation::Local(dir.into()), options).unwrap()
}

fn columns() -> Columns {
    Columns::image_classification(1, 28, 28)
}

fn plan(slice: Slice, window: Option<u64>, first: (u32, u64), end_epoch: u32, rows: u64) -> Plan {
    let shuffle = window.map(|window| Shuffle { seed: 7, window });
    Plan { slice, shuffle, first, end_epoch, steps_per_epoch: slice.steps(rows) }
}

fn drain(ds: &Dataset, split: Split, plan: Plan) -> Vec<Batch> {
    let mut stream = ds.reader(split, &columns()).unwrap().open(plan);
    std::iter::from_fn(|| stream.next_batch().unwrap()).collect()
}

fn slice(rank: u64, workers: u64, batch: u64, training: bool) -> Slice {
    Slice { rank, workers, batch, training }
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

#[test]
fn with_a_window_over_the_split_the_batches_are_the_idx_loaders_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let (idx, parquet) = dataset(tmp.path());
    let ds = open(&parquet);
    assert_eq!((ds.split(Split::Train).unwrap().rows(), ds.split(Split::Test).unwrap().rows()), (1000, 210));
    assert_eq!(ds.split(Split::Train).unwrap().files.len(), 4);
    for (split, training) in [(Split::Train, true), (Split::Test, false)] {
        let mnist = Mnist::load(&idx, split).unwrap();
        for rank in 0..2u32 {
            let s = slice(u64::from(rank), 2, 16, training);
            let window = training.then_some(1 << 20);
            let batches = drain(&ds, split, plan(s, window, (0, 0), 2, mnist.len() as u64));
            let mut expected = Vec::new();
            for epoch in 0..2u64 {
                let ctx = InputContext {
                    num_input_pipelines: 2,
                    input_pipeline_id: rank,
                    per_replica_batch_size: 16,
                    training,
                    epoch,
                    seed: 7,
                    first_step: 0,
                };
                expected.extend(mnist.pipeline(&ctx).unwrap().batches.map(Result::unwrap));
            }
            assert_eq!(batches.len(), expected.len());
            for (got, want) in batches.iter().zip(&expected) {
                let names = |b: &trainerd_sdk::Batch| b.iter().map(|(n, _)| n.to_string()).collect::<Vec<_>>();
                assert_eq!(names(&got.columns), ["image", "label"]);
                assert!(
                    names(want) == names(&got.columns)
                        && got.columns.iter().zip(want.iter()).all(|((_, a), (_, b))| same(a, b)),
                    "{split:?} rank {rank} epoch {} step {}",
                    got.epoch,
                    got.step
                );
            }
        }
    }
}

/// Each batch's (epoch, step) and example ids.
type Ids = Vec<((u32, u64), Vec<(u32, u64)>)>;

/// Example ids of every batch, by (epoch, step).
fn ids(batches: &[Batch]) -> Ids {
    batches.iter().map(|b| ((b.epoch, b.step), b.ids.clone())).collect()
}

#[test]
fn a_windowed_order_is_the_same_for_any_worker_count_and_from_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let ds = open(&parquet);
    let rows = 1000;
    // 130 rows a window: windows straddle row groups (50 rows) and steps (24 rows).
    let window = Some(130);
    let one = drain(&ds, Split::Train, plan(slice(0, 1, 24, true), window, (0, 0), 3, rows));
    let four: Vec<Vec<Batch>> =
        (0..4).map(|r| drain(&ds, Split::Train, plan(slice(r, 4, 6, true), window, (0, 0), 3, rows))).collect();
    assert_eq!(one.len(), 3 * 41);
    for (i, whole) in one.iter().enumerate() {
        let joined: Vec<(u32, u64)> = four.iter().flat_map(|w| w[i].ids.clone()).collect();
        assert_eq!(joined, whole.ids, "step {} of epoch {}", whole.step, whole.epoch);
        let xs =
            Tensor::cat(&four.iter().map(|w| w[i].columns.input().unwrap().shallow_clone()).collect::<Vec<_>>(), 0);
        assert!(same(&xs, whole.columns.input().unwrap()));
    }
    // Each epoch takes distinct rows (its first 984 positions), and the epochs differ.
    let epoch =
        |e: u32| -> Vec<(u32, u64)> { one.iter().filter(|b| b.epoch == e).flat_map(|b| b.ids.clone()).collect() };
    for e in 0..3 {
        let mut sorted = epoch(e);
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 984, "epoch {e} repeats no example");
    }
    assert_ne!(epoch(0), epoch(1));
    // Opened at every step of the epoch boundaries, a stream yields what the whole run yields from there.
    let whole = ids(&one);
    for first in [(0, 38), (0, 39), (0, 40), (1, 0), (1, 1), (1, 2)] {
        let at = whole.iter().position(|(k, _)| *k == first).unwrap();
        let resumed = ids(&drain(&ds, Split::Train, plan(slice(0, 1, 24, true), window, first, 3, rows)));
        assert_eq!(resumed, whole[at..], "opened at {first:?}");
    }
}

#[test]
fn evaluation_covers_every_row_once_in_file_order() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let ds = open(&parquet);
    let shards: Vec<Vec<Batch>> =
        (0..3).map(|r| drain(&ds, Split::Test, plan(slice(r, 3, 8, false), None, (0, 0), 1, 210))).collect();
    assert!(shards.iter().all(|s| s.len() == 9), "every worker takes as many steps");
    let mut all: Vec<(u32, u64)> = shards.iter().flatten().flat_map(|b| b.ids.clone()).collect();
    all.sort_unstable();
    assert_eq!(all, (0..210).map(|r| (0, r)).collect::<Vec<_>>());
    // The last global batch holds 18 rows: 8, 8 and the last worker's 2.
    assert_eq!(shards[2][8].columns.examples(), 2, "the last worker's share of the last batch is short");
}

#[test]
fn each_worker_reads_every_row_group_once_an_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let ds = open(&parquet);
    let projected = ds.reader(Split::Train, &columns()).unwrap().projected_bytes();
    let files: u64 = ds.split(Split::Train).unwrap().bytes();
    assert!(projected < files, "the footers and the unread path column are not read");
    // Rank 1 of 2, windows of 130 rows straddling row groups.
    drain(&ds, Split::Train, plan(slice(1, 2, 12, true), Some(130), (0, 0), 2, 1000));
    let traffic = ds.traffic();
    for epoch in 0..2 {
        assert_eq!(traffic[&Purpose::Train(epoch)].fetched, projected, "epoch {epoch}: each row group once");
    }
    assert!(ds.peak_held_bytes() > 0);
}

#[test]
fn a_damaged_row_group_names_its_file_and_row_group() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let file = parquet.join("train-00001-of-00004.parquet");
    let ds = open(&parquet);
    let meta = ds.split(Split::Train).unwrap().files[1].meta.metadata().clone();
    let (start, _) = meta.row_group(2).column(0).byte_range();
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[start as usize..start as usize + 16].fill(0xff);
    // Same size and mtime: a damage the ETag check cannot see (as a bad disk sector).
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    std::fs::write(&file, bytes).unwrap();
    std::fs::File::options().append(true).open(&file).unwrap().set_modified(mtime).unwrap();
    let mut stream =
        ds.reader(Split::Train, &columns()).unwrap().open(plan(slice(0, 1, 50, false), None, (0, 0), 1, 1000));
    let err = loop {
        match stream.next_batch() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the damaged row group went unnoticed"),
            Err(e) => break e.to_string(),
        }
    };
    let prefix = format!("data file {}, row group 2: ", file.display());
    assert!(err.starts_with(&prefix), "{err}");
}

#[test]
fn a_file_changed_under_the_run_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let ds = open(&parquet);
    let file = parquet.join("train-00002-of-00004.parquet");
    let copy = std::fs::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    std::fs::write(&file, copy).unwrap();
    let mut stream =
        ds.reader(Split::Train, &columns()).unwrap().open(plan(slice(0, 1, 50, false), None, (0, 0), 1, 1000));
    let err = std::iter::from_fn(|| stream.next_batch().transpose()).find_map(Result::err).expect("an error");
    assert_eq!(
        err.to_string(),
        format!(
            "data file {}: it is not the file it was (its ETag is no longer {}) since the run started; a dataset must \
             not change under a running job (restart the run to train on the new data)",
            file.display(),
            ds.split(Split::Train).unwrap().files[2].file.etag.as_deref().unwrap()
        )
    );
}

#[test]
fn a_missing_shard_a_wrong_schema_and_a_file_that_is_not_parquet_are_refused_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    let options = || Options {
        s3: S3Options::default(),
        timeout: Duration::from_secs(5),
        cache: None,
        threads: 1,
        observer: Arc::new(Quiet),
    };
    let location = DataLocation::Local(parquet.clone());

    let mut columns = columns();
    columns.0[1].name = "class".into();
    let err = open(&parquet).reader(Split::Train, &columns).err().unwrap().to_string();
    assert_eq!(
        err,
        format!(
            "data file {}: no column `class` (the plugin reads it as an integer); the file has: image (struct<bytes: \
             binary, path: string>), label (int64)",
            parquet.join("train-00000-of-00004.parquet").display()
        )
    );

    let not_parquet = parquet.join("test-00000-of-00001.parquet");
    std::fs::write(&not_parquet, b"label,image\n1,abc\n").unwrap();
    let err = Dataset::open(&location, options()).err().unwrap().to_string();
    assert_eq!(
        err,
        format!(
            "data file {}: not a readable Parquet file: it does not end with PAR1 (damaged, or not Parquet)",
            not_parquet.display()
        )
    );

    std::fs::remove_file(parquet.join("train-00002-of-00004.parquet")).unwrap();
    let err = Dataset::open(&location, options()).err().unwrap().to_string();
    assert_eq!(
        err,
        format!(
            "data location {}: missing train-00002-of-00004.parquet (train has 4 files by its names: 3 found)",
            parquet.display()
        )
    );
}

/// Without a test split the validation split serves evaluation; without either, the dataset
/// opens for training alone, and a reader of the test split says there is none.
#[test]
fn the_validation_split_serves_where_there_is_no_test_split() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, parquet) = dataset(tmp.path());
    std::fs::rename(parquet.join("test-00000-of-00001.parquet"), parquet.join("validation-00000-of-00001.parquet"))
        .unwrap();
    let ds = open(&parquet);
    let test = ds.split(Split::Test).unwrap();
    assert_eq!((test.name, test.rows()), ("validation", 210));
    std::fs::remove_file(parquet.join("validation-00000-of-00001.parquet")).unwrap();
    let ds = open(&parquet);
    assert!(ds.split(Split::Test).is_none());
    assert_eq!(
        ds.reader(Split::Test, &columns()).err().unwrap().to_string(),
        format!(
            "data location {}: no test split: expected test-00000-of-0000N.parquet files (Hugging Face's layout) or \
             test.parquet",
            parquet.display()
        )
    );
}
