//! The run's tokenizer: a Hugging Face `tokenizer.json`, read by Hugging Face's own Rust
//! `tokenizers` (the crate the Python package wraps, pinned to the venv's version), found
//! beside the dataset or named by a flag (a local file or an S3 object); its sha256, its
//! end-of-text token and its ids' range.
//!
//! An S3 object is fetched as the dataset's files are (the same S3 settings, reads retried
//! within `--data-timeout`) and kept in the data cache under its ETag, so a worker fetches it
//! once while it is unchanged. Its sha256 is of its bytes, as a local file's: the same
//! tokenizer is the same identity wherever it was read from.

use std::path::PathBuf;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use trainerd_storage::Location;

use super::TextOptions;
use crate::error::{DataError, FetchError, TextError};
use crate::location::DataLocation;
use crate::source::{Purpose, Source};
use crate::Dataset;

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

/// Where `--tokenizer` names a `tokenizer.json`: `PATH`, `file:///PATH` or `s3://bucket/key`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerLocation {
    /// A local file.
    Local(PathBuf),
    /// An S3 object.
    S3 {
        /// Its bucket.
        bucket: String,
        /// Its key.
        key: String,
    },
}

impl std::str::FromStr for TokenizerLocation {
    type Err = TextError;

    fn from_str(text: &str) -> Result<TokenizerLocation, TextError> {
        let err = |reason: String| TextError::Url { text: text.to_string(), reason };
        // The grammar of the data and checkpoint locations, so that every flag reads alike.
        match text.parse::<Location>() {
            Ok(Location::Local(path)) => Ok(TokenizerLocation::Local(path)),
            Ok(Location::S3 { bucket, prefix: key }) if !key.is_empty() && !text.ends_with('/') => {
                Ok(TokenizerLocation::S3 { bucket, key })
            }
            Ok(Location::S3 { .. }) => Err(err("names no object: expected s3://bucket/key of a tokenizer.json".into())),
            Ok(Location::Memory) => Err(err("expected a file, file:///path or s3://bucket/key".into())),
            Err(e) => Err(err(e
                .reason
                .replace(
                    "a directory, file:///path, s3://bucket/prefix or memory://",
                    "a file, file:///path or s3://bucket/key",
                )
                .replace("key prefix", "key"))),
        }
    }
}

impl std::fmt::Display for TokenizerLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerLocation::Local(path) => write!(f, "{}", path.display()),
            TokenizerLocation::S3 { bucket, key } => write!(f, "s3://{bucket}/{key}"),
        }
    }
}

impl Dataset {
    /// The tokenizer `options` name, or the one beside the dataset.
    pub fn tokenizer(&self, options: &TextOptions) -> Result<Tokenizer, DataError> {
        let (location, bytes) = match &options.tokenizer {
            Some(TokenizerLocation::Local(path)) => {
                let shown = path.display().to_string();
                let bytes =
                    std::fs::read(path).map_err(|source| TextError::Unreadable { path: shown.clone(), source })?;
                (shown, bytes)
            }
            Some(url @ TokenizerLocation::S3 { bucket, key }) => {
                let fetch = |e| TextError::Fetch { url: url.to_string(), reason: e };
                (url.to_string(), self.fetch(bucket, key).map_err(fetch)?)
            }
            None => {
                let listed = self.source.list()?;
                let found = listed.iter().find(|f| f.name == FILE);
                let file = found.ok_or_else(|| TextError::NoTokenizer { location: self.location().to_string() })?;
                let bytes = self.source.read(file, 0..file.size, Purpose::Index)?;
                (self.location().file(&file.name), bytes.to_vec())
            }
        };
        Ok(Tokenizer::from_bytes(location, &bytes, options.eos.as_deref())?)
    }

    /// The object `key` of `bucket`, read as the dataset's files are, through the data cache.
    fn fetch(&self, bucket: &str, key: &str) -> Result<Vec<u8>, FetchError> {
        let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
        let location = DataLocation::S3 { bucket: bucket.to_string(), prefix: prefix.to_string() };
        let (s3, timeout, observer) = &self.fetching;
        let source =
            Source::open(&location, s3, *timeout, self.cache.clone(), Arc::clone(observer)).map_err(FetchError::of)?;
        let file = source.head(name).map_err(FetchError::of)?.ok_or(FetchError::NotFound)?;
        // Keyed by the ETag (and size) the head gave, and read with If-Match on it.
        let bytes = source.read(&file, 0..file.size, Purpose::Index).map_err(FetchError::of)?;
        Ok(bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dataset_without_a_tokenizer_is_told_the_file_it_looks_for() {
        let e = TextError::NoTokenizer { location: "s3://b/d".into() };
        assert!(e.to_string().contains(&format!("has no {FILE} beside its Parquet files")), "{e}");
    }

    fn parse(text: &str) -> Result<TokenizerLocation, String> {
        text.parse().map_err(|e: TextError| e.to_string())
    }

    #[test]
    fn locations_parse_and_show_as_given() {
        let s3 = |bucket: &str, key: &str| TokenizerLocation::S3 { bucket: bucket.into(), key: key.into() };
        assert_eq!(parse("tok/tokenizer.json"), Ok(TokenizerLocation::Local("tok/tokenizer.json".into())));
        assert_eq!(parse("file:///m/tokenizer.json"), Ok(TokenizerLocation::Local("/m/tokenizer.json".into())));
        assert_eq!(parse("s3://models/gpt2/tokenizer.json"), Ok(s3("models", "gpt2/tokenizer.json")));
        assert_eq!(parse("s3://models/tokenizer.json"), Ok(s3("models", "tokenizer.json")));
        for text in ["s3://models/gpt2/tokenizer.json", "s3://models/tokenizer.json", "/m/tokenizer.json"] {
            assert_eq!(parse(text).unwrap().to_string(), text);
        }
    }

    #[test]
    fn a_location_that_names_no_file_is_refused_saying_what_is_expected() {
        let expected = "expected s3://bucket/key of a tokenizer.json";
        for text in ["s3://models", "s3://models/", "s3://models/gpt2/"] {
            assert_eq!(parse(text), Err(format!("--tokenizer {text:?}: names no object: {expected}")));
        }
        assert_eq!(
            parse("gs://models/tokenizer.json"),
            Err("--tokenizer \"gs://models/tokenizer.json\": unknown scheme \"gs\"; expected a file, file:///path or \
                 s3://bucket/key"
                .into())
        );
        assert_eq!(
            parse("memory://"),
            Err("--tokenizer \"memory://\": expected a file, file:///path or s3://bucket/key".into())
        );
        assert!(parse("s3://Models/tokenizer.json").unwrap_err().contains("the bucket name must be 3-63 characters"));
        assert_eq!(
            parse("s3://models/a/../tokenizer.json"),
            Err(
                "--tokenizer \"s3://models/a/../tokenizer.json\": the key must not contain empty, '.' or '..' segments"
                    .into()
            )
        );
    }

    /// A failed read says what it means for the tokenizer: gone, or not allowed, or the store's
    /// own error.
    #[test]
    fn fetch_failures_name_the_cause() {
        let store = |e: object_store::Error| DataError::Source { file: "s3://b/k".into(), source: e };
        let denied = object_store::Error::PermissionDenied { path: "k".into(), source: "403 Forbidden".into() };
        assert!(matches!(FetchError::of(store(denied)), FetchError::Denied(_)));
        let unauthenticated = object_store::Error::Unauthenticated { path: "k".into(), source: "401".into() };
        let said = TextError::Fetch { url: "s3://b/k".into(), reason: FetchError::of(store(unauthenticated)) };
        assert!(said.to_string().starts_with("tokenizer s3://b/k: no permission to read it (check the S3 credentials"));
        let gone = DataError::Changed { file: "s3://b/k".into(), what: "it is gone".into() };
        assert!(matches!(FetchError::of(gone), FetchError::NotFound));
        let unavailable = DataError::Unavailable {
            file: "s3://b/k".into(),
            waited: std::time::Duration::from_secs(60),
            last: "503".into(),
        };
        let said = TextError::Fetch { url: "s3://b/k".into(), reason: FetchError::of(unavailable) };
        assert_eq!(
            said.to_string(),
            "tokenizer s3://b/k: S3 kept failing for 60 s (last error: 503); gave up after --data-timeout"
        );
        let missing = TextError::Fetch { url: "s3://b/k".into(), reason: FetchError::NotFound };
        assert_eq!(missing.to_string(), "tokenizer s3://b/k: no such object (check the bucket and the key)");
    }
}
