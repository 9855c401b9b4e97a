//! The run's data, whichever kind `--data` names, behind one interface for training and
//! evaluation (the steps of an epoch, and batches from any (epoch, step) on):
//! - a directory in the plugin's own format (MNIST's idx files), read by the plugin through the
//!   ABI, one epoch's pipeline at a time;
//! - a columnar dataset (Parquet in Hugging Face's layout, on a directory or S3), read by
//!   `trainerd-data` for the columns the plugin declares, in a stream that runs across epochs.
//!
//! A columnar dataset is opened before the cluster forms: its fingerprint and the shuffle window
//! are part of what every worker must agree on, and of every checkpoint's run configuration.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;
use trainerd_data::{DataLocation, Dataset, Options, Plan, Reader, Shuffle, Slice, Stream};
use trainerd_sdk::{InputContext, PluginInfo, Split};

use crate::ops::Telemetry;
use crate::plugin::{self, CallError, InputPipeline, ModelInstance};

/// Why the data cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// The columnar dataset failed.
    #[error(transparent)]
    Data(#[from] trainerd_data::DataError),
    /// The plugin's own reader failed.
    #[error(transparent)]
    Plugin(#[from] CallError),
    /// A columnar dataset for a plugin that declares no columns.
    #[error(
        "plugin {plugin} declares no columns, so it cannot train on the Parquet dataset at {location}: it reads only \
         its own format from a directory (rebuild it declaring PluginInfo::columns)"
    )]
    NoColumns {
        /// The plugin.
        plugin: String,
        /// The dataset.
        location: String,
    },
    /// A shuffle window of no rows.
    #[error("--shuffle-window 0: expected at least 1 row")]
    NoWindow,
    /// An evaluation asked of a run that does not evaluate (a bug).
    #[error("no test split was opened: this run does not evaluate")]
    NoEvaluation,
    /// Nothing to evaluate on, and evaluation not turned off.
    #[error(
        "data location {location}: no test or validation split (test-00000-of-0000N.parquet or validation-…): every \
         epoch ends with an evaluation on it; give --no-evaluation to train without one"
    )]
    NoTestSplit {
        /// The dataset.
        location: String,
    },
}

/// What `--data` names.
#[derive(Clone)]
pub enum DataSource {
    /// A directory in the plugin's own format, and whether its test split is read (evaluated).
    Plugin(PathBuf, bool),
    /// A columnar dataset, indexed.
    Files(Arc<Files>),
}

/// A columnar dataset, opened, with the readers of the plugin's columns.
pub struct Files {
    /// The dataset.
    pub dataset: Dataset,
    /// Rows shuffled together in training.
    pub window: u64,
    /// The training split's reader.
    pub train: Reader,
    /// The test split's reader (the validation split's where there is no test split); none when
    /// the run does not evaluate.
    pub test: Option<Reader>,
}

impl std::fmt::Debug for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Plugin(dir, _) => write!(f, "Plugin({})", dir.display()),
            DataSource::Files(files) => {
                write!(f, "Files({}, {})", files.dataset.location(), files.dataset.fingerprint())
            }
        }
    }
}

impl DataSource {
    /// What `text` names for `info`'s plugin: a columnar dataset (an `s3://` prefix, or a
    /// directory of `.parquet` files), opened and checked against the plugin's columns; else a
    /// directory the plugin reads itself. `evaluate`: the test split is needed.
    pub fn open(
        text: &str,
        info: &PluginInfo,
        (window, evaluate): (u64, bool),
        options: Options,
    ) -> Result<DataSource, InputError> {
        let location: DataLocation = text.parse()?;
        if !location.is_columnar() {
            let DataLocation::Local(dir) = location else { unreachable!("S3 is always columnar") };
            return Ok(DataSource::Plugin(dir, evaluate));
        }
        let Some(columns) = info.columns.clone() else {
            return Err(InputError::NoColumns { plugin: info.name.clone(), location: location.to_string() });
        };
        if window == 0 {
            return Err(InputError::NoWindow);
        }
        let dataset = Dataset::open(&location, options)?;
        let train = dataset.reader(Split::Train, &columns)?;
        let test = match (evaluate, dataset.split(Split::Test)) {
            (false, _) => None,
            (true, None) => return Err(InputError::NoTestSplit { location: location.to_string() }),
            (true, Some(_)) => Some(dataset.reader(Split::Test, &columns)?),
        };
        Ok(DataSource::Files(Arc::new(Files { dataset, window, train, test })))
    }

    /// What every worker must agree on about the data (none for a plugin's own format, whose
    /// reading the plugin's identity covers).
    pub fn agreement(&self) -> Option<serde_json::Value> {
        let DataSource::Files(f) = self else { return None };
        Some(serde_json::json!({
            "format": "parquet",
            "fingerprint": f.dataset.fingerprint(),
            "shuffle_window": f.window,
        }))
    }

    /// One line on the data, for the run's first lines.
    pub fn describe(&self) -> String {
        match self {
            DataSource::Plugin(dir, _) => format!("data: {} (the plugin's own format)", dir.display()),
            DataSource::Files(f) => {
                let train = f.dataset.split(Split::Train).expect("a dataset always has a training split");
                let test = match (&f.test, f.dataset.split(Split::Test)) {
                    (Some(_), Some(t)) => format!(
                        "{} {} file(s), {} rows{}",
                        t.files.len(),
                        t.name,
                        crate::ops::progress::thousands(t.rows() as f64),
                        if t.name == "test" { "" } else { ", evaluated as the test split" }
                    ),
                    _ => "no evaluation (--no-evaluation)".into(),
                };
                let shuffle = if f.window >= train.rows() {
                    "every epoch a uniform shuffle".to_string()
                } else {
                    format!(
                        "row groups shuffled, then windows of {} rows",
                        crate::ops::progress::thousands(f.window as f64)
                    )
                };
                format!(
                    "data: Parquet at {} ({} train file(s), {} rows; {test}; fingerprint {}); {shuffle}",
                    f.dataset.location(),
                    train.files.len(),
                    crate::ops::progress::thousands(train.rows() as f64),
                    &f.dataset.fingerprint()[..16],
                )
            }
        }
    }
}

/// What a worker read of a columnar dataset, as the summary reports it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DataFigures {
    /// The dataset's location.
    pub location: String,
    /// Its fingerprint.
    pub fingerprint: String,
    /// Rows shuffled together in training.
    pub shuffle_window: u64,
    /// Rows of the training split.
    pub train_rows: u64,
    /// Bytes of the training split's files.
    pub train_bytes: u64,
    /// Bytes of the training split's row groups that the plugin's columns project: the most a
    /// worker fetches in an epoch (each row group once).
    pub train_projected_bytes: u64,
    /// Bytes fetched (and served from the local cache) for each training epoch this process read.
    pub train_epochs: Vec<(u32, trainerd_data::Traffic)>,
    /// Bytes read for the evaluations, all epochs together.
    pub test: trainerd_data::Traffic,
    /// Bytes of footers read.
    pub index: trainerd_data::Traffic,
    /// The most bytes of rows held at once (read, not yet batched).
    pub peak_held_bytes: u64,
}

impl DataSource {
    /// What this worker read, for a columnar dataset.
    pub fn figures(&self) -> Option<DataFigures> {
        let DataSource::Files(f) = self else { return None };
        let traffic = f.dataset.traffic();
        let train = f.dataset.split(Split::Train).expect("a dataset always has a training split");
        let mut test = trainerd_data::Traffic::default();
        let mut train_epochs = Vec::new();
        for (purpose, t) in &traffic {
            match purpose {
                trainerd_data::Purpose::Train(e) => train_epochs.push((*e, *t)),
                trainerd_data::Purpose::Test(_) => {
                    test.fetched += t.fetched;
                    test.from_cache += t.from_cache;
                }
                trainerd_data::Purpose::Index => {}
            }
        }
        Some(DataFigures {
            location: f.dataset.location().to_string(),
            fingerprint: f.dataset.fingerprint().to_string(),
            shuffle_window: f.window,
            train_rows: train.rows(),
            train_bytes: train.bytes(),
            train_projected_bytes: f.train.projected_bytes(),
            train_epochs,
            test,
            index: traffic.get(&trainerd_data::Purpose::Index).copied().unwrap_or_default(),
            peak_held_bytes: f.dataset.peak_held_bytes() as u64,
        })
    }
}

/// Tells the telemetry (systemd's `STATUS=` and watchdog, `/healthz`) that the data source is
/// failing and retried within its bound, and when it answers again.
pub struct Watch(pub Arc<Telemetry>);

impl trainerd_data::Observer for Watch {
    fn retrying(&self, file: &str, error: &str, waited: Duration, bound: Duration) {
        self.0.waiting(&format!("data source retrying {file}: {error}"), bound.saturating_sub(waited));
    }

    fn recovered(&self, _: &str, _: Duration) {
        self.0.progress();
    }
}

/// One batch: this worker's slice of a global batch.
pub struct Batch {
    /// Its epoch.
    pub epoch: u32,
    /// Its step (from 0).
    pub step: u64,
    /// Inputs.
    pub xs: Tensor,
    /// Labels.
    pub ys: Tensor,
    /// Its example ids (file, row), when the data has them (a columnar dataset).
    pub ids: Option<Vec<(u32, u64)>>,
}

/// A run's data, with its model.
pub enum Data<'m> {
    /// Read by the plugin.
    Plugin {
        /// The training split.
        train: plugin::Dataset<'m>,
        /// The test split, when the run evaluates.
        test: Option<plugin::Dataset<'m>>,
    },
    /// Read by trainerd.
    Files(Arc<Files>),
}

impl<'m> Data<'m> {
    /// The data `source` names, for `model`.
    pub fn load(source: &DataSource, model: &'m ModelInstance<'m>) -> Result<Data<'m>, InputError> {
        Ok(match source {
            DataSource::Plugin(dir, evaluate) => {
                let test = evaluate.then(|| model.load_data(dir, Split::Test)).transpose()?;
                Data::Plugin { train: model.load_data(dir, Split::Train)?, test }
            }
            DataSource::Files(files) => Data::Files(Arc::clone(files)),
        })
    }

    /// Steps in an epoch of the training split for `ctx`'s slice.
    pub fn steps(&self, ctx: &InputContext) -> Result<u64, InputError> {
        match self {
            Data::Plugin { train, .. } => Ok(train.pipeline(ctx)?.steps()),
            Data::Files(f) => Ok(slice(ctx).steps(f.train.rows())),
        }
    }

    /// Batches of `ctx` (its split by `ctx.training`) from `(ctx.epoch, ctx.first_step)` on:
    /// to the end of that epoch, or (a columnar dataset's training) through epoch `end_epoch - 1`,
    /// `steps_per_epoch` steps each.
    pub fn open(&self, ctx: &InputContext, (end_epoch, steps_per_epoch): (u32, u64)) -> Result<Epochs<'_>, InputError> {
        match self {
            Data::Plugin { train, test } => {
                let data = if ctx.training { Some(train) } else { test.as_ref() };
                let pipeline = data.ok_or(InputError::NoEvaluation)?.pipeline(ctx)?;
                let steps = pipeline.steps().min(steps_per_epoch);
                Ok(Epochs::Plugin { pipeline, epoch: ctx.epoch as u32, next: ctx.first_step, steps })
            }
            Data::Files(f) => {
                let slice = slice(ctx);
                let (reader, shuffle, end, steps) = if ctx.training {
                    (&f.train, Some(Shuffle { seed: ctx.seed, window: f.window }), end_epoch, steps_per_epoch)
                } else {
                    let test = f.test.as_ref().ok_or(InputError::NoEvaluation)?;
                    (test, None, ctx.epoch as u32 + 1, slice.steps(test.rows()))
                };
                let first = (ctx.epoch as u32, ctx.first_step);
                Ok(Epochs::Files(reader.open(Plan { slice, shuffle, first, end_epoch: end, steps_per_epoch: steps })))
            }
        }
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
pub enum Epochs<'d> {
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
}

impl Epochs<'_> {
    /// The next batch, or `None` at the end.
    pub fn next_batch(&mut self) -> Result<Option<Batch>, InputError> {
        match self {
            Epochs::Plugin { pipeline, epoch, next, steps } => {
                if *next >= *steps {
                    return Ok(None);
                }
                let Some((xs, ys)) = pipeline.next_batch()? else { return Ok(None) };
                *next += 1;
                Ok(Some(Batch { epoch: *epoch, step: *next - 1, xs, ys, ids: None }))
            }
            Epochs::Files(stream) => Ok(stream.next_batch()?.map(|b| Batch {
                epoch: b.epoch,
                step: b.step,
                xs: b.xs,
                ys: b.ys,
                ids: Some(b.ids),
            })),
        }
    }
}
