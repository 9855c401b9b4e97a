//! One pass over a split's documents: each row group's text column read (in file order),
//! tokenized on the loader threads, each non-empty document's ids followed by the end-of-text
//! token and appended to a token stream (little-endian u32) in the data cache. Memory holds one
//! row group's documents and ids at a time. The stream and its counts are kept under a key of
//! everything that decides them (the data's fingerprint, the split, the column, the tokenizer's
//! sha256, the end-of-text id), so that a later run on the same data and tokenizer reads it
//! instead of tokenizing again; the counts are written last, so a pass cut short leaves nothing
//! usable. Streams count against the cache's bound and are evicted with its entries, least
//! recently used first, never while a process holds one ([`crate::cache`]).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use trainerd_sdk::{Column, Columns, Decode, Split};

use super::{TextError, TextOptions, Tokenizer};
use crate::cache::InUse;
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

/// A split's token stream in the data cache, held: no eviction removes it while this, or the
/// blocks made of it, lives.
#[derive(Debug)]
pub struct TokenFile {
    /// The file.
    pub path: PathBuf,
    /// What it holds.
    pub counts: Counts,
    /// Whether this run tokenized it (else an earlier run did, and it was read again).
    pub made: bool,
    /// The open file, held.
    pub held: InUse,
}

/// The version of the token files' layout, in their key.
const FORMAT: &str = "trainerd-tokens/1";

impl Dataset {
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
        let cache = self.cache.as_ref().ok_or_else(|| TextError::NoCache { location: self.location().to_string() })?;
        if let Some((held, counts)) = cache.open_stream(&key).and_then(kept) {
            return Ok(TokenFile { path: held.path().to_path_buf(), counts, made: false, held });
        }
        // Workers on one host may share the cache: each writes its own file (see the cache).
        let writer = cache.write_stream(&key)?;
        let partial = writer.path().to_path_buf();
        let mut out = std::io::BufWriter::with_capacity(1 << 20, writer.file());
        let counts = self.pass(index, options, tokenizer, (&mut out, &partial), progress)?;
        let flushed = out.flush();
        drop(out);
        flushed.map_err(|source| TextError::Cache { path: partial.display().to_string(), source })?;
        let held = writer.finish(&serde_json::to_vec(&counts).expect("plain numbers"))?;
        Ok(TokenFile { path: held.path().to_path_buf(), counts, made: true, held })
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

/// The counts of a token stream an earlier pass finished, when its size fits them.
fn kept((held, counts): (InUse, Vec<u8>)) -> Option<(InUse, Counts)> {
    let counts: Counts = serde_json::from_slice(&counts).ok()?;
    let size = held.file().metadata().ok()?.len();
    (size == counts.tokens * 4).then_some((held, counts))
}
