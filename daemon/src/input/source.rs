//! What `--data` names: a directory in the plugin's own format, or a columnar dataset opened,
//! indexed and checked against the plugin's columns; what every worker must agree on about it,
//! and what a worker read of it (the summary's figures).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use trainerd_data::text::TextOptions;
use trainerd_data::{DataLocation, Dataset, Options, Reader};
use trainerd_sdk::{PluginInfo, Split};

use super::text::Text;
use super::InputError;
use crate::ops::Telemetry;

/// What `--data` names.
#[derive(Clone)]
pub(crate) enum DataSource {
    /// A directory in the plugin's own format, and whether its test split is read (evaluated).
    Plugin(PathBuf, bool),
    /// A columnar dataset, indexed.
    Files(Arc<Files>),
    /// Raw text, tokenized and packed.
    Text(Arc<super::text::Text>),
}

/// A columnar dataset, opened, with the readers of the plugin's columns.
pub(crate) struct Files {
    /// The dataset.
    pub(crate) dataset: Dataset,
    /// Rows shuffled together in training.
    pub(crate) window: u64,
    /// The training split's reader.
    pub(crate) train: Reader,
    /// The test split's reader (the validation split's where there is no test split); none when
    /// the run does not evaluate.
    pub(crate) test: Option<Reader>,
}

impl std::fmt::Debug for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Plugin(dir, _) => write!(f, "Plugin({})", dir.display()),
            DataSource::Files(files) => {
                write!(f, "Files({}, {})", files.dataset.location(), files.dataset.fingerprint())
            }
            DataSource::Text(t) => write!(f, "Text({}, {})", t.dataset.location(), t.tokenizer.sha256),
        }
    }
}

impl DataSource {
    /// What `text` names for `info`'s plugin: a columnar dataset (an `s3://` prefix, or a
    /// directory of `.parquet` files), opened and checked against the plugin's columns (its raw
    /// text tokenized and packed, for a `text` column, `say` told how); else a directory the
    /// plugin reads itself. `evaluate`: the test split is needed.
    pub(crate) fn open(
        text: &str,
        info: &PluginInfo,
        (window, evaluate): (u64, bool),
        (options, text_options): (Options, &TextOptions),
        say: &mut dyn FnMut(&str),
    ) -> Result<DataSource, InputError> {
        let location: DataLocation = text.parse()?;
        if !location.is_columnar() {
            let DataLocation::Local(dir) = location else { unreachable!("S3 is always columnar") };
            return Ok(DataSource::Plugin(dir, evaluate));
        }
        let Some(columns) = info.columns.clone() else {
            return Err(InputError::NoColumns { plugin: info.name.clone(), location: location.to_string() });
        };
        if let Some(packed) = columns.packed_text() {
            let opening = (options, text_options, evaluate);
            return Ok(DataSource::Text(Arc::new(Text::open(&location, info, packed, opening, say)?)));
        }
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
    pub(crate) fn agreement(&self) -> Option<serde_json::Value> {
        let f = match self {
            DataSource::Plugin(..) => return None,
            DataSource::Text(t) => return Some(t.agreement()),
            DataSource::Files(f) => f,
        };
        Some(serde_json::json!({
            "format": "parquet",
            "fingerprint": f.dataset.fingerprint(),
            "shuffle_window": f.window,
        }))
    }

    /// One line on the data, for the run's first lines.
    pub(crate) fn describe(&self) -> String {
        match self {
            DataSource::Plugin(dir, _) => format!("data: {} (the plugin's own format)", dir.display()),
            DataSource::Text(t) => t.describe(),
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
pub(crate) struct DataFigures {
    /// The dataset's location.
    pub(crate) location: String,
    /// Its fingerprint.
    pub(crate) fingerprint: String,
    /// Rows shuffled together in training.
    pub(crate) shuffle_window: u64,
    /// Rows of the training split.
    pub(crate) train_rows: u64,
    /// Bytes of the training split's files.
    pub(crate) train_bytes: u64,
    /// Bytes of the training split's row groups that the plugin's columns project: the most a
    /// worker fetches in an epoch (each row group once).
    pub(crate) train_projected_bytes: u64,
    /// Bytes fetched (and served from the local cache) for each training epoch this process read.
    pub(crate) train_epochs: Vec<(u32, trainerd_data::Traffic)>,
    /// Bytes read for the evaluations, all epochs together.
    pub(crate) test: trainerd_data::Traffic,
    /// Bytes of footers read.
    pub(crate) index: trainerd_data::Traffic,
    /// The most bytes of rows held at once (read, not yet batched).
    pub(crate) peak_held_bytes: u64,
}

impl DataSource {
    /// What this worker read, for a columnar dataset.
    pub(crate) fn figures(&self) -> Option<DataFigures> {
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
                trainerd_data::Purpose::Index | trainerd_data::Purpose::Tokenize => {}
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
pub(crate) struct Watch(pub(crate) Arc<Telemetry>);

impl trainerd_data::Observer for Watch {
    fn retrying(&self, file: &str, error: &str, waited: Duration, bound: Duration) {
        self.0.waiting(&format!("data source retrying {file}: {error}"), bound.saturating_sub(waited));
    }

    fn recovered(&self, _: &str, _: Duration) {
        self.0.progress();
    }
}
