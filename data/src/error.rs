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
    Text(#[from] TextError),
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

/// Why raw text cannot be packed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// No tokenizer beside the dataset, and none named.
    #[error(
        "the model trains on raw text, and data location {location} has no tokenizer.json beside its Parquet files: \
         give --tokenizer PATH or s3://bucket/key (the model's tokenizer.json) or put it there"
    )]
    NoTokenizer {
        /// The dataset.
        location: String,
    },
    /// `--tokenizer` names no file or S3 object.
    #[error("--tokenizer {text:?}: {reason}")]
    Url {
        /// The text given.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// A tokenizer on S3 that cannot be fetched.
    #[error("tokenizer {url}: {reason}")]
    Fetch {
        /// Its URL.
        url: String,
        /// Why.
        #[source]
        reason: FetchError,
    },
    /// A tokenizer file that cannot be read.
    #[error("tokenizer {path}: {source}")]
    Unreadable {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file that is not a tokenizer.
    #[error("tokenizer {location}: not a Hugging Face tokenizer.json: {reason}")]
    NotATokenizer {
        /// The file.
        location: String,
        /// What the parser said.
        reason: String,
    },
    /// None of the known end-of-text tokens.
    #[error(
        "tokenizer {location} has none of the end-of-text tokens trainerd knows ({tried}): name the token that ends \
         each document with --eos-token"
    )]
    NoEos {
        /// The file.
        location: String,
        /// The tokens tried.
        tried: String,
    },
    /// An end-of-text token the tokenizer does not have.
    #[error("--eos-token {token:?}: tokenizer {location} has no such token")]
    UnknownEos {
        /// The file.
        location: String,
        /// The token.
        token: String,
    },
    /// The tokenizer failed on some text.
    #[error("tokenizer {location} failed on data file {file}, row group {row_group}: {reason}")]
    Encode {
        /// The tokenizer.
        location: String,
        /// The data file.
        file: String,
        /// Its row group.
        row_group: usize,
        /// What it said.
        reason: String,
    },
    /// Fewer tokens than one block.
    #[error(
        "the {split} split of {location} has {tokens} token(s) in {documents} document(s) (with their end-of-text \
         tokens): fewer than one block of {length}; give the model a shorter length or the split more text"
    )]
    TooFew {
        /// The split's name.
        split: String,
        /// The dataset.
        location: String,
        /// Its tokens.
        tokens: u64,
        /// Its non-empty documents.
        documents: u64,
        /// The block length.
        length: u32,
    },
    /// A dataset opened without a cache, which token streams live in.
    #[error("data location {location}: raw text is tokenized into the data cache, and none was given")]
    NoCache {
        /// The dataset.
        location: String,
    },
    /// The token file cannot be written or read.
    #[error("token cache {path}: {source}")]
    Cache {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Why a tokenizer on S3 could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// No such object (or no such bucket).
    #[error("no such object (check the bucket and the key)")]
    NotFound,
    /// The credentials may not read it.
    #[error(
        "no permission to read it (check the S3 credentials, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and the \
         bucket's policy): {0}"
    )]
    Denied(#[source] object_store::Error),
    /// The store's error.
    #[error("{0}")]
    Store(#[source] object_store::Error),
    /// The store kept failing past the retries' bound.
    #[error("S3 kept failing for {:.0} s (last error: {last}); gave up after --data-timeout", waited.as_secs_f64())]
    Unavailable {
        /// How long it was retried.
        waited: std::time::Duration,
        /// The last error.
        last: String,
    },
    /// Anything else (the S3 settings, the cache).
    #[error("{0}")]
    Read(#[source] Box<DataError>),
}

impl FetchError {
    /// What a failed read of the tokenizer means for it.
    pub(crate) fn of(e: DataError) -> FetchError {
        use object_store::Error as E;
        match e {
            DataError::Source { source: source @ (E::PermissionDenied { .. } | E::Unauthenticated { .. }), .. } => {
                FetchError::Denied(source)
            }
            // Gone between the head and the read.
            DataError::Source { source: E::NotFound { .. }, .. } | DataError::Changed { .. } => FetchError::NotFound,
            DataError::Source { source, .. } | DataError::Store { source, .. } => FetchError::Store(source),
            DataError::Unavailable { waited, last, .. } => FetchError::Unavailable { waited, last },
            e => FetchError::Read(Box::new(e)),
        }
    }
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
