//! What can go wrong with a dataset, each error naming the thing to repair: the location, the
//! file, the row group, the row, the column, and what was expected and found.

use std::path::PathBuf;
use std::time::Duration;

pub use crate::codec::{DecodeError, ValueError};

/// `f`'s result, or its panic as an error saying `what` panicked (a decoder fed damaged bytes
/// may panic; on the loader's pool that would end the process).
pub fn caught<T>(
    what: impl FnOnce(Panicked) -> DataError,
    f: impl FnOnce() -> Result<T, DataError>,
) -> Result<T, DataError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(what(Panicked { message: panic_message(&*payload) })))
}

/// A decoder that panicked, and what it said.
#[derive(Debug, thiserror::Error)]
#[error("the decoder panicked: {message}")]
pub struct Panicked {
    /// The panic's message.
    pub message: String,
}

/// What a caught panic said.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// A dataset problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// `--data` could not be parsed or opened.
    #[error("data location {location}: {reason}")]
    Location {
        /// The location as given.
        location: String,
        /// What is wrong.
        reason: String,
    },
    /// A split has no files.
    #[error(
        "data location {location}: no {split} split: expected {split}-00000-of-0000N.parquet files (Hugging Face's \
         layout) or {split}.parquet{found}"
    )]
    NoSplit {
        /// The location.
        location: String,
        /// Which split.
        split: &'static str,
        /// What the location holds instead, as "; found: a, b" (empty when nothing).
        found: String,
    },
    /// A numbered shard is absent.
    #[error("data location {location}: missing {name} ({split} has {total} files by its names: {present} found)")]
    MissingShard {
        /// The location.
        location: String,
        /// The split.
        split: &'static str,
        /// The missing file's name.
        name: String,
        /// Files the names say there are.
        total: usize,
        /// Files found.
        present: usize,
    },
    /// A file is not Parquet, or its footer is damaged.
    #[error("data file {file}: not a readable Parquet file: {reason}")]
    NotParquet {
        /// The file.
        file: String,
        /// What is wrong.
        #[source]
        reason: FooterError,
    },
    /// A column the plugin declares is absent.
    #[error("data file {file}: no column `{column}` (the plugin reads it as {expected}); the file has: {available}")]
    MissingColumn {
        /// The file.
        file: String,
        /// The column.
        column: String,
        /// What the plugin expects of it.
        expected: String,
        /// The file's columns.
        available: String,
    },
    /// A column's type does not fit the plugin's declaration.
    #[error("data file {file}: column `{column}`: expected {expected}, found {found}")]
    Schema {
        /// The file.
        file: String,
        /// The column.
        column: String,
        /// What the plugin declares.
        expected: String,
        /// The column's type.
        found: String,
    },
    /// The plugin declares a column that makes no sense.
    #[error("data file {file}: column `{column}`: expected a valid declaration in the plugin, found {reason}")]
    Declaration {
        /// The dataset.
        file: String,
        /// The column.
        column: String,
        /// What is wrong with its declaration.
        #[source]
        reason: trainerd_sdk::DeclarationError,
    },
    /// A column compressed with a codec this build does not read.
    #[error(
        "data file {file}: column `{column}` is compressed with {codec}, which this trainerd does not read (it reads \
         uncompressed, snappy, gzip, lz4 and zstd); rewrite the file with one of those (pyarrow and pandas write \
         snappy by default)"
    )]
    Codec {
        /// The file.
        file: String,
        /// The column (its path in the file).
        column: String,
        /// The codec.
        codec: String,
    },
    /// A row group could not be read or decoded.
    #[error("data file {file}, row group {row_group}: {reason}")]
    RowGroup {
        /// The file.
        file: String,
        /// The row group (from 0).
        row_group: usize,
        /// What failed.
        #[source]
        reason: GroupError,
    },
    /// One row's value does not fit the declaration (an image of another size, a null, a list of
    /// the wrong length).
    #[error("data file {file}, row group {row_group}, row {row}: column `{column}`: {reason}")]
    Row {
        /// The file.
        file: String,
        /// The row group.
        row_group: usize,
        /// The row, counted from the file's first.
        row: u64,
        /// The column.
        column: String,
        /// What is wrong.
        #[source]
        reason: Box<ValueError>,
    },
    /// A file changed (or vanished) under the running job.
    #[error(
        "data file {file}: {what} since the run started; a dataset must not change under a running job (restart the \
         run to train on the new data)"
    )]
    Changed {
        /// The file.
        file: String,
        /// What changed.
        what: String,
    },
    /// The data source kept failing for longer than the wait bound.
    #[error(
        "data file {file}: the data source failed for {:.0} s (last error: {last}); gave up after --data-timeout",
        waited.as_secs_f64()
    )]
    Unavailable {
        /// The file being read.
        file: String,
        /// How long it was retried.
        waited: Duration,
        /// The last error.
        last: String,
    },
    /// The source failed definitely (permissions, a bad request).
    #[error("data file {file}: {source}")]
    Source {
        /// The file.
        file: String,
        /// The store's error.
        source: object_store::Error,
    },
    /// The location could not be listed, or its store not made.
    #[error("data location {location}: {source}")]
    Store {
        /// The location.
        location: String,
        /// The store's error.
        source: object_store::Error,
    },
    /// The loader's threads or I/O runtime could not start.
    #[error("data location {location}: {what}: {source}")]
    Start {
        /// The location.
        location: String,
        /// What could not start.
        what: &'static str,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Making a batch panicked.
    #[error("data location {location}: {source}")]
    Panicked {
        /// The location.
        location: String,
        /// What the decoder said.
        source: Panicked,
    },
    /// The local cache could not be used.
    #[error("data cache {path}: {source}")]
    Cache {
        /// The cache file or directory.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Writing a dataset (`data convert`).
    #[error("{what}: {reason}")]
    Write {
        /// What was being written.
        what: String,
        /// What failed.
        #[source]
        reason: WriteError,
    },
    /// Raw text that cannot be tokenized and packed.
    #[error(transparent)]
    Text(#[from] crate::text::TextError),
    /// libtorch failed making a batch's tensors.
    #[error("making a batch: {0}")]
    Torch(#[from] trainerd_sdk::tch::TchError),
    /// The pipeline's threads were stopped (the stream was dropped).
    #[error("the input pipeline was stopped")]
    Stopped,
}

/// Why a file's footer does not make it a readable Parquet file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FooterError {
    /// Fewer bytes than the smallest Parquet file.
    #[error("{0} bytes is too short for a Parquet file")]
    TooShort(u64),
    /// No `PAR1` at the end.
    #[error("it does not end with PAR1 (damaged, or not Parquet)")]
    NoMagic,
    /// An encrypted footer.
    #[error("its footer is encrypted")]
    Encrypted,
    /// A footer longer than the file.
    #[error("its footer claims {claims} bytes, the file has {size}")]
    TooLong {
        /// The footer's length, as it says.
        claims: u64,
        /// The file's.
        size: u64,
    },
    /// The footer's metadata does not decode.
    #[error("its footer does not decode: {0}")]
    Decode(#[source] parquet::errors::ParquetError),
    /// The decoder panicked on it.
    #[error("its footer does not decode: {}", .0.message)]
    Panicked(#[source] Panicked),
    /// Its schema has no Arrow form.
    #[error("its schema has no Arrow form: {0}")]
    Schema(#[source] parquet::errors::ParquetError),
}

/// Why a row group could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// Parquet failed reading it.
    #[error("{0}")]
    Parquet(#[source] parquet::errors::ParquetError),
    /// Arrow failed decoding it.
    #[error("{0}")]
    Arrow(#[source] arrow_schema::ArrowError),
    /// A column asked for was not read.
    #[error("no column `{0}` read")]
    NoColumn(String),
    /// Fewer rows than selected.
    #[error("{read} rows read of the {selected} selected")]
    Count {
        /// Rows read.
        read: usize,
        /// Rows selected.
        selected: usize,
    },
    /// A decoder panicked on it.
    #[error(transparent)]
    Panicked(#[from] Panicked),
}

/// Why a dataset could not be written (`trainerd data convert`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// A local file or directory.
    #[error("{0}")]
    Io(#[source] std::io::Error),
    /// The MNIST-format source.
    #[error("{0}")]
    Mnist(#[source] trainerd_sdk::mnist::DataError),
    /// Parquet's writer.
    #[error("{0}")]
    Parquet(#[source] parquet::errors::ParquetError),
    /// A record batch.
    #[error("{0}")]
    Arrow(#[source] arrow_schema::ArrowError),
    /// An image's PNG encoding.
    #[error("{0}")]
    Png(#[source] png::EncodingError),
    /// The store's error.
    #[error("{0}")]
    Store(#[source] object_store::Error),
}
