//! Raw text as language models train on it: a split's documents (a string column of its Parquet
//! files, `text` in Hugging Face's datasets) tokenized by the model's `tokenizer.json`, each
//! followed by the end-of-text token, concatenated in file order and cut into blocks of the
//! model's length, the last partial block dropped: no padding and no token wasted, as torchtitan
//! packs.
//!
//! - [`tokenizer`]: the tokenizer, beside the dataset or named by a flag (a file or an S3
//!   object).
//! - [`pack`]: one pass over the split (row group by row group, in bounded memory) that
//!   tokenizes every document and writes the token stream to the data cache ([`crate::cache`],
//!   whose bound it counts against), kept by the data's fingerprint, the column and the
//!   tokenizer's hash, so that the next run on the same data reads it again instead.
//! - [`blocks`]: the blocks of an epoch in a pure function of (seed, epoch) (a uniform shuffle of
//!   the blocks; evaluation in order), each read from the token file.
//!
//! Packing first and shuffling the blocks keeps the order independent of the worker count, and
//! lets every worker read any block without tokenizing what precedes it.

pub mod blocks;
pub mod pack;
pub mod tokenizer;

pub use blocks::{BlockBatch, BlockStream, Blocks};
pub use pack::Counts;
pub use tokenizer::{FetchError, Tokenizer, TokenizerLocation};

/// How a run finds and reads its text: the flags. Its token streams go to the dataset's cache
/// ([`crate::Options::cache`]).
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// `--tokenizer`: a `tokenizer.json` on local disk or S3; `None`: the one beside the
    /// dataset.
    pub tokenizer: Option<TokenizerLocation>,
    /// `--text-column`: the documents' column.
    pub column: String,
    /// `--eos-token`: the token that ends each document; `None`: the tokenizer's own.
    pub eos: Option<String>,
}

/// Why raw text cannot be packed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// No tokenizer beside the dataset, and none named.
    #[error(
        "the model trains on raw text, and data location {location} has no {} beside its Parquet files: give \
         --tokenizer PATH or s3://bucket/key (the model's tokenizer.json) or put it there",
        tokenizer::FILE
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
