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

pub use crate::error::{FetchError, TextError};
pub use blocks::{BlockBatch, BlockStream, Blocks};
pub use pack::Counts;
pub use tokenizer::{Tokenizer, TokenizerLocation};

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
