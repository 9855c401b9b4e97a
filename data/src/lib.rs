//! Datasets as users have them: sharded Parquet files (Hugging Face's layout: `train-*` and
//! `test-*` files) on a local directory or an S3-compatible prefix, read by the daemon for any
//! plugin that declares its columns ([`trainerd_sdk::Columns`]).
//!
//! - [`location`]: what `--data` names, and whether it is a columnar dataset.
//! - [`index`]: the files of each split, their footers, the fingerprint (made once at start).
//! - [`schema`]: each file's columns checked against the plugin's declaration, before training.
//! - [`order`]: the order of an epoch, a pure function of (seed, epoch, row groups, window).
//! - [`source`] and [`cache`]: byte ranges read against the files as they were at start, retried
//!   within a bound, remote ones cached on local disk within a bound that raw text's token
//!   streams count against too.
//! - [`rows`], [`batch`]: a row group's wanted rows, and a batch's tensors; [`codec`]: its images
//!   (PNG and JPEG).
//! - [`stream`]: the prefetching pipeline, in bounded memory.
//! - [`convert`]: an MNIST-format directory written as Parquet in Hugging Face's layout.
//! - [`predictions`]: `trainerd predict`'s file of outputs per example.
//! - [`text`]: raw text, tokenized and packed into blocks (language models).
//!
//! This crate knows nothing of the cluster or of training: a worker hands it its slice and the
//! step to start at, and gets batches.

pub mod batch;
pub mod cache;
pub mod codec;
pub mod convert;
pub mod error;
pub mod index;
pub mod location;
pub mod order;
pub mod predictions;
pub mod rows;
pub mod schema;
pub mod source;
pub mod stream;
pub mod text;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use trainerd_sdk::{Columns, Split};
use trainerd_storage::S3Options;

pub use error::DataError;
pub use index::SplitIndex;
pub use location::DataLocation;
pub use order::{Shuffle, Slice};
pub use source::{Observer, Purpose, Quiet, Traffic};
pub use stream::{Batch, Plan, Stream};

/// How a dataset is read.
#[derive(Clone)]
pub struct Options {
    /// S3 settings (the checkpoints' flags).
    pub s3: S3Options,
    /// How long a read waits for a failing source before it is an error.
    pub timeout: Duration,
    /// The local cache (directory, bytes): remote ranges, and raw text's token streams, which
    /// need one.
    pub cache: Option<(PathBuf, u64)>,
    /// Loader threads (reading row groups, decoding images).
    pub threads: usize,
    /// Told of the source's failures and recoveries.
    pub observer: Arc<dyn Observer>,
}

/// An opened dataset: both splits indexed.
pub struct Dataset {
    source: Arc<source::Source>,
    pool: Arc<rayon::ThreadPool>,
    train: Arc<SplitIndex>,
    test: Option<Arc<SplitIndex>>,
    fingerprint: String,
    peak_bytes: Arc<AtomicUsize>,
    patience: Duration,
    /// The cache, shared with the source (remote ranges) and the token streams.
    cache: Option<Arc<cache::Cache>>,
    /// How other files are fetched (a tokenizer on S3): as the dataset's.
    fetching: (S3Options, Duration, Arc<dyn Observer>),
}

impl Dataset {
    /// Opens the dataset at `location`: lists it, reads every file's footer, and checks that
    /// both splits are there and whole.
    pub fn open(location: &DataLocation, options: Options) -> Result<Dataset, DataError> {
        // Opened for local data too: its token streams live there.
        let cache = match &options.cache {
            Some((dir, bytes)) => Some(Arc::new(cache::Cache::open(dir, *bytes)?)),
            None => None,
        };
        let fetching = (options.s3.clone(), options.timeout, Arc::clone(&options.observer));
        let source = source::Source::open(location, &options.s3, options.timeout, cache.clone(), options.observer)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(options.threads.max(1))
            .thread_name(|i| format!("trainerd-loader-{i}"))
            .start_handler(|_| {
                single_threaded_openmp();
                batch_scheduling();
            })
            .build()
            .map_err(|e| DataError::Start {
                location: location.to_string(),
                what: "cannot start its loader threads",
                source: Box::new(e),
            })?;
        let listed = source.list()?;
        let train = index::index_split(&source, &listed, (Split::Train, "train"), &pool)?;
        // Evaluation reads the test split, else the validation split (Hugging Face's datasets
        // often have one and not the other), else nothing: a run then needs --no-evaluation.
        let mut test = None;
        for name in ["test", "validation"] {
            match index::index_split(&source, &listed, (Split::Test, name), &pool) {
                Ok(index) => {
                    test = Some(Arc::new(index));
                    break;
                }
                Err(DataError::NoSplit { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        let splits: Vec<&SplitIndex> = std::iter::once(&train).chain(test.as_deref()).collect();
        let fingerprint = index::fingerprint(&splits);
        Ok(Dataset {
            source: Arc::new(source),
            pool: Arc::new(pool),
            train: Arc::new(train),
            test,
            fingerprint,
            peak_bytes: Arc::default(),
            // A batch waits at most for its reads, each bounded by the timeout, and their decoding.
            patience: options.timeout * 2 + Duration::from_secs(60),
            cache,
            fetching,
        })
    }

    /// The location.
    pub fn location(&self) -> &DataLocation {
        self.source.location()
    }

    /// A split's index: the test split's is the validation split's where there is no test
    /// split, and none where there is neither.
    pub fn split(&self, split: Split) -> Option<&SplitIndex> {
        match split {
            Split::Train => Some(&self.train),
            Split::Test => self.test.as_deref(),
        }
    }

    /// sha256 of every file's split, name, size and footer (see [`index`]).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// A reader of `split`'s `columns`, every file's schema checked first.
    pub fn reader(&self, split: Split, columns: &Columns) -> Result<Reader, DataError> {
        let index = match split {
            Split::Train => &self.train,
            Split::Test => self.test.as_ref().ok_or_else(|| DataError::NoSplit {
                location: self.location().to_string(),
                split: "test",
                found: String::new(),
            })?,
        };
        let projections = index::check(&self.source, index, columns)?;
        Ok(Reader {
            input: Arc::new(stream::Input {
                source: Arc::clone(&self.source),
                split: Arc::clone(index),
                projections,
                columns: columns.clone(),
                pool: Arc::clone(&self.pool),
                peak_bytes: Arc::clone(&self.peak_bytes),
            }),
            patience: self.patience,
        })
    }

    /// Bytes read so far, by purpose.
    pub fn traffic(&self) -> BTreeMap<Purpose, Traffic> {
        self.source.traffic()
    }

    /// The most bytes of rows held at once by the pipelines (read, not yet batched).
    pub fn peak_held_bytes(&self) -> usize {
        self.peak_bytes.load(Ordering::Relaxed)
    }
}

/// Makes libtorch run single-threaded on this thread: a loader thread makes tensors (libtorch
/// fills a new tensor with a parallel kernel), and OpenMP's thread count is per thread, so
/// without this each loader thread would start a team of its own whose spinning takes the
/// training threads' cores. ATen sizes its OpenMP regions by the calling thread's count, which
/// this sets, leaving the training thread's alone. libgomp comes with libtorch, not linked here:
/// the function is looked up where libtorch loaded it.
fn single_threaded_openmp() {
    // SAFETY: dlsym with a NUL-terminated name; a non-null result is libgomp's
    // `void omp_set_num_threads(int)`, called once with a valid count.
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, c"omp_set_num_threads".as_ptr());
        if !f.is_null() {
            let set: extern "C" fn(libc::c_int) = std::mem::transmute(f);
            set(1);
        }
    }
}

/// Puts the calling thread under Linux's `SCHED_BATCH` policy: it keeps its fair share of the
/// CPU but never preempts a thread when it wakes. A loader thread wakes whenever the step takes a
/// batch; without this it took the training thread's core at once, for the whole time it made
/// the next batch (360 us a step, seen, with every core training).
pub(crate) fn batch_scheduling() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler on the calling thread (pid 0) with a valid parameter; a
        // refusal leaves the thread as it was, which only costs speed.
        unsafe {
            libc::sched_setscheduler(0, libc::SCHED_BATCH, &param);
        }
    }
}

/// One split's rows as a plugin's columns decode them.
#[derive(Clone)]
pub struct Reader {
    input: Arc<stream::Input>,
    patience: Duration,
}

impl Reader {
    /// Rows in the split.
    pub fn rows(&self) -> u64 {
        self.input.split.rows()
    }

    /// The number in the split (files in name order, rows in file order, from 0) of the example
    /// `id` (file, row in the file).
    pub fn example_number(&self, (file, row): (u32, u64)) -> u64 {
        self.input.split.files[file as usize].first_row + row
    }

    /// Bytes of the split's row groups that the columns project: what one worker reads of it in
    /// an epoch (each row group at most once).
    pub fn projected_bytes(&self) -> u64 {
        let (split, projections) = (&self.input.split, &self.input.projections);
        split
            .groups
            .iter()
            .map(|g| {
                let r = rows::byte_range(split.files[g.file].meta.metadata(), g.index, &projections[g.file].leaves);
                r.end - r.start
            })
            .sum()
    }

    /// The batches of `plan`, made ahead on the loader threads.
    pub fn open(&self, plan: Plan) -> Stream {
        Stream::open(Arc::clone(&self.input), plan, self.patience)
    }
}
