//! One pass over a split's documents: each row group's text column read (in file order),
//! tokenized on the loader threads, each non-empty document's ids followed by the end-of-text
//! token and appended to a local token file (little-endian u32). Memory holds one row group's
//! documents and ids at a time. The file and its counts are kept under a key of everything that
//! decides them (the data's fingerprint, the split, the column, the tokenizer's sha256, the
//! end-of-text id), so that a later run on the same data and tokenizer reads it instead of
//! tokenizing again; the counts are written last, so a pass cut short leaves nothing usable.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use trainerd_sdk::{Column, Columns, Decode, Split};

use super::{TextError, TextOptions, Tokenizer};
use crate::error::DataError;
use crate::index::SplitIndex;
use crate::rows::{self, Chunk, Place, Value};
use crate::source::Purpose;
use crate::Dataset;

/// What a split's pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Documents with at least one token.
    pub documents: u64,
    /// Documents with none (the empty string), skipped.
    pub empty: u64,
    /// Tokens in the stream, each document's end-of-text token included.
    pub tokens: u64,
    /// The largest id in the stream.
    pub max_id: u32,
}

/// A split's token stream on local disk.
#[derive(Debug)]
pub struct TokenFile {
    /// The file.
    pub path: PathBuf,
    /// What it holds.
    pub counts: Counts,
    /// Whether this run tokenized it (else an earlier run did, and it was read again).
    pub made: bool,
}

/// The version of the token files' layout, in their key.
const FORMAT: &str = "trainerd-tokens/1";

impl Dataset {
    /// The tokenizer `options` name, or the one beside the dataset.
    pub fn tokenizer(&self, options: &TextOptions) -> Result<Tokenizer, DataError> {
        let (location, bytes) = match &options.tokenizer {
            Some(path) => {
                let shown = path.display().to_string();
                let bytes =
                    std::fs::read(path).map_err(|source| TextError::Unreadable { path: shown.clone(), source })?;
                (shown, bytes)
            }
            None => {
                let listed = self.source.list()?;
                let found = listed.iter().find(|f| f.name == super::tokenizer::FILE);
                let file = found.ok_or_else(|| TextError::NoTokenizer { location: self.location().to_string() })?;
                let bytes = self.source.read(file, 0..file.size, Purpose::Index)?;
                (self.location().file(&file.name), bytes.to_vec())
            }
        };
        Ok(Tokenizer::from_bytes(location, &bytes, options.eos.as_deref())?)
    }

    /// `split`'s documents in `options.column`, tokenized by `tokenizer` into a token file (or the
    /// one an earlier pass made); `progress` hears (row groups done, row groups, tokens so far).
    pub fn tokenize(
        &self,
        split: Split,
        options: &TextOptions,
        tokenizer: &Tokenizer,
        progress: &mut dyn FnMut(usize, usize, u64),
    ) -> Result<TokenFile, DataError> {
        let index = self.split(split).ok_or_else(|| DataError::NoSplit {
            location: self.location().to_string(),
            split: "test",
            found: String::new(),
        })?;
        let key = self.token_key(index, options, tokenizer);
        let (path, counts_path) =
            (options.cache.join(format!("{key}.tokens")), options.cache.join(format!("{key}.json")));
        let cache_error = |path: &Path| {
            let path = path.display().to_string();
            move |source| TextError::Cache { path, source }
        };
        if let Some(counts) = kept(&path, &counts_path) {
            return Ok(TokenFile { path, counts, made: false });
        }
        std::fs::create_dir_all(&options.cache).map_err(cache_error(&options.cache))?;
        // Workers on one host may share the directory: each writes its own file, and the renames
        // (of the same bytes) replace one another atomically.
        let partial = options.cache.join(format!("{key}.tokens.{}.partial", std::process::id()));
        let file = std::fs::File::create(&partial).map_err(cache_error(&partial))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let counts = self.pass(index, options, tokenizer, (&mut out, &partial), progress)?;
        out.flush().and_then(|()| out.get_ref().sync_all()).map_err(cache_error(&partial))?;
        std::fs::rename(&partial, &path).map_err(cache_error(&path))?;
        let json = serde_json::to_vec(&counts).expect("plain numbers");
        let counts_partial = options.cache.join(format!("{key}.json.{}.partial", std::process::id()));
        std::fs::write(&counts_partial, json).map_err(cache_error(&counts_partial))?;
        std::fs::rename(&counts_partial, &counts_path).map_err(cache_error(&counts_path))?;
        Ok(TokenFile { path, counts, made: true })
    }

    /// Tokenizes every row group of `index` in order into `out`.
    fn pass(
        &self,
        index: &SplitIndex,
        options: &TextOptions,
        tokenizer: &Tokenizer,
        (out, path): (&mut impl Write, &Path),
        progress: &mut dyn FnMut(usize, usize, u64),
    ) -> Result<Counts, DataError> {
        let columns = Columns(vec![Column { name: options.column.clone(), decode: Decode::Text { length: 1 } }]);
        let projections = crate::index::check(&self.source, index, &columns)?;
        let mut counts = Counts::default();
        let eos = tokenizer.eos.1;
        let mut bytes_out = Vec::new();
        for (done, group) in index.groups.iter().enumerate() {
            let file = &index.files[group.file];
            let projection = &projections[group.file];
            let range = rows::byte_range(file.meta.metadata(), group.index, &projection.leaves);
            let bytes = self.source.read(&file.file, range.clone(), Purpose::Tokenize)?;
            let shown = self.location().file(&file.file.name);
            let place = Place { file: &shown, group: group.index, first_row: group.first_row_in_file };
            let chunk = Chunk { start: range.start, bytes, file_len: file.file.size };
            let all: Vec<u64> = (0..file.meta.metadata().row_group(group.index).num_rows() as u64).collect();
            let read = rows::read(place, &file.meta, chunk, (projection, &columns), &all)?;
            let texts: Vec<&str> = read
                .iter()
                .map(|row| match &row.values[0] {
                    Value::Text(t) => t.as_str(),
                    _ => unreachable!("a text column reads as text"),
                })
                .collect();
            let ids = self.pool.install(|| tokenizer.encode(texts)).map_err(|reason| TextError::Encode {
                location: tokenizer.location.clone(),
                file: shown.clone(),
                row_group: group.index,
                reason,
            })?;
            bytes_out.clear();
            for doc in ids {
                if doc.is_empty() {
                    counts.empty += 1;
                    continue;
                }
                counts.documents += 1;
                counts.tokens += doc.len() as u64 + 1;
                for id in doc.into_iter().chain([eos]) {
                    counts.max_id = counts.max_id.max(id);
                    bytes_out.extend_from_slice(&id.to_le_bytes());
                }
            }
            let written = out.write_all(&bytes_out);
            written.map_err(|source| TextError::Cache { path: path.display().to_string(), source })?;
            progress(done + 1, index.groups.len(), counts.tokens);
        }
        Ok(counts)
    }

    /// The token file's key: sha256 of everything that decides its contents.
    fn token_key(&self, index: &SplitIndex, options: &TextOptions, tokenizer: &Tokenizer) -> String {
        let mut h = Sha256::new();
        for part in [FORMAT, self.fingerprint(), index.name, &options.column, &tokenizer.sha256] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        h.update(tokenizer.eos.1.to_le_bytes());
        h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
    }
}

/// The counts of a token file an earlier pass finished, when its size fits them.
fn kept(path: &Path, counts: &Path) -> Option<Counts> {
    let counts: Counts = serde_json::from_slice(&std::fs::read(counts).ok()?).ok()?;
    let size = std::fs::metadata(path).ok()?.len();
    (size == counts.tokens * 4).then_some(counts)
}
