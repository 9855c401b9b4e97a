//! The run's tokenizer: a Hugging Face `tokenizer.json`, read by Hugging Face's own Rust
//! `tokenizers` (the crate the Python package wraps, pinned to the venv's version), found
//! beside the dataset or named by a flag; its sha256, its end-of-text token and its ids' range.

use sha2::{Digest, Sha256};

use super::TextError;

/// The tokenizer's file name beside a dataset's Parquet files (as every Hugging Face model
/// ships it).
pub const FILE: &str = "tokenizer.json";

/// The end-of-text tokens of common model families, tried in order when none is named:
/// GPT-2's, Llama 3's, Llama 2's and T5's, Gemma's, Qwen's.
pub const EOS_TOKENS: [&str; 5] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"];

/// A tokenizer read from a `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was read from, as messages name it.
    pub location: String,
    /// sha256 of the file's bytes: every worker's must be the same.
    pub sha256: String,
    /// The token that follows each document, and its id.
    pub eos: (String, u32),
    /// One more than its largest id: the rows a model's embedding needs.
    pub vocab: u64,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("location", &self.location).field("sha256", &self.sha256).finish()
    }
}

impl Tokenizer {
    /// The tokenizer in `bytes` (read from `location`), its end-of-text token `eos` or the first
    /// of [`EOS_TOKENS`] it has.
    pub fn from_bytes(location: String, bytes: &[u8], eos: Option<&str>) -> Result<Tokenizer, TextError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| TextError::NotATokenizer { location: location.clone(), reason: e.to_string() })?;
        let eos = match eos {
            Some(token) => match inner.token_to_id(token) {
                Some(id) => (token.to_string(), id),
                None => return Err(TextError::UnknownEos { location, token: token.to_string() }),
            },
            None => EOS_TOKENS
                .iter()
                .find_map(|t| inner.token_to_id(t).map(|id| (t.to_string(), id)))
                .ok_or_else(|| TextError::NoEos { location: location.clone(), tried: EOS_TOKENS.join(", ") })?,
        };
        let vocab = inner.get_vocab(true).values().max().map_or(0, |&m| u64::from(m) + 1);
        let sha256 = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
        Ok(Tokenizer { inner, location, sha256, eos, vocab })
    }

    /// Each document's token ids, without special tokens (the end-of-text token is the packer's
    /// to add), on the calling thread's rayon pool.
    pub fn encode(&self, documents: Vec<&str>) -> Result<Vec<Vec<u32>>, String> {
        let encodings = self.inner.encode_batch_fast(documents, false).map_err(|e| e.to_string())?;
        Ok(encodings.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }
}
