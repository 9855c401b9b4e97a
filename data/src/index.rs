//! A dataset's index, made once at start: each split's files (Hugging Face's names:
//! `{split}-{i:05d}-of-{n:05d}.parquet`, or `{split}.parquet`, sorted by name), each file's footer
//! (row groups, schema), the split's row groups in file order, and the dataset's fingerprint.
//!
//! The fingerprint is the sha256 of every file's name, size and footer. The footer holds every
//! row group's column offsets, sizes and statistics, so two copies of one dataset (one per node,
//! say) have the same fingerprint and a rewritten file another. It is not the ETags: a local
//! file's ETag names its inode, which differs between copies. ETags guard the run instead: every
//! read of a file carries the ETag seen at start.

use std::sync::Arc;

use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::basic::Compression;
use parquet::file::metadata::{FooterTail, ParquetMetaData, ParquetMetaDataReader};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use trainerd_sdk::{Columns, Split};

use crate::error::{panic_message, DataError, FooterError, Panicked};
use crate::order::Layout;
use crate::schema::{self, Projection};
use crate::source::{FileRef, Purpose, Source};

/// Bytes fetched at first from a file's end: most footers fit, so one request reads them.
const FOOTER_GUESS: u64 = 64 << 10;

/// One Parquet file of a split.
#[derive(Clone, Debug)]
pub struct ParquetFile {
    /// The file as listed at start.
    pub file: FileRef,
    /// Its footer, decoded, with its Arrow schema.
    pub meta: ArrowReaderMetadata,
    /// sha256 of its raw footer.
    pub footer_sha256: [u8; 32],
    /// Its first row in the split.
    pub first_row: u64,
}

/// One row group of a split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    /// Its file, by index in the split.
    pub file: usize,
    /// Its index in the file.
    pub index: usize,
    /// Its first row, counted from the file's first.
    pub first_row_in_file: u64,
}

/// A split: its files and row groups.
#[derive(Debug)]
pub struct SplitIndex {
    /// Which split it serves as.
    pub split: Split,
    /// Its name in the files' names: `train`, `test`, or `validation` (serving as the test split
    /// of a dataset that has none).
    pub name: &'static str,
    /// Its files, sorted by name.
    pub files: Vec<ParquetFile>,
    /// Its row groups, in file order.
    pub groups: Vec<Group>,
    /// Where each row group starts, and the rows.
    pub layout: Layout,
}

impl SplitIndex {
    /// Rows in the split.
    pub fn rows(&self) -> u64 {
        self.layout.rows
    }

    /// Bytes of its files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.file.size).sum()
    }

    /// The example id of `row`: (file index in sorted order, row in that file).
    pub fn example_id(&self, row: u64) -> (u32, u64) {
        let f = self.files.partition_point(|f| f.first_row <= row) - 1;
        (f as u32, row - self.files[f].first_row)
    }
}

/// `split`'s name in file names.
pub fn split_name(split: Split) -> &'static str {
    match split {
        Split::Train => "train",
        Split::Test => "test",
    }
}

/// The files of the split named `name` among `files` (sorted by name), checked complete when
/// their names number them (`-{i}-of-{n}`).
pub fn split_files(location: &str, files: &[FileRef], name: &'static str) -> Result<Vec<FileRef>, DataError> {
    let ours: Vec<FileRef> = files
        .iter()
        .filter(|f| {
            f.name.ends_with(".parquet")
                && f.name.strip_prefix(name).is_some_and(|rest| rest.starts_with('-') || rest == ".parquet")
        })
        .cloned()
        .collect();
    if ours.is_empty() {
        let others: Vec<&str> = files.iter().map(|f| f.name.as_str()).take(8).collect();
        let found = if others.is_empty() { String::new() } else { format!("; found: {}", others.join(", ")) };
        return Err(DataError::NoSplit { location: location.to_string(), split: name, found });
    }
    let numbered: Vec<(usize, usize)> = ours.iter().filter_map(|f| shard_number(&f.name, name)).collect();
    if numbered.len() == ours.len() {
        let total = numbered[0].1;
        for i in 0..total {
            if !numbered.contains(&(i, total)) {
                return Err(DataError::MissingShard {
                    location: location.to_string(),
                    split: name,
                    name: format!("{name}-{i:05}-of-{total:05}.parquet"),
                    total,
                    present: ours.len(),
                });
            }
        }
    }
    Ok(ours)
}

/// `(i, n)` of a name `{split}-{i}-of-{n}[-anything].parquet`.
fn shard_number(file: &str, split: &str) -> Option<(usize, usize)> {
    let rest = file.strip_prefix(split)?.strip_prefix('-')?.strip_suffix(".parquet")?;
    let mut parts = rest.splitn(4, '-');
    let i = parts.next()?.parse().ok()?;
    (parts.next()? == "of").then_some(())?;
    let n = parts.next()?.parse().ok()?;
    Some((i, n))
}

/// Indexes `split` (the files named `name`): lists its files among `listed`, reads their
/// footers (on `pool`).
pub fn index_split(
    source: &Source,
    listed: &[FileRef],
    (split, name): (Split, &'static str),
    pool: &rayon::ThreadPool,
) -> Result<SplitIndex, DataError> {
    let files = split_files(&source.location().to_string(), listed, name)?;
    let footers: Vec<_> =
        pool.install(|| files.par_iter().map(|f| read_footer(source, f)).collect::<Result<_, _>>())?;
    let (mut parquet_files, mut groups, mut sizes, mut first_row) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for (i, (file, (meta, footer_sha256))) in files.into_iter().zip(footers).enumerate() {
        let mut in_file = 0;
        for (g, rg) in meta.metadata().row_groups().iter().enumerate() {
            let rows = rg.num_rows().max(0) as u64;
            groups.push(Group { file: i, index: g, first_row_in_file: in_file });
            sizes.push(rows);
            in_file += rows;
        }
        parquet_files.push(ParquetFile { file, meta, footer_sha256, first_row });
        first_row += in_file;
    }
    Ok(SplitIndex { split, name, files: parquet_files, groups, layout: Layout::of_sizes(&sizes) })
}

/// A file's footer: decoded, and the sha256 of its bytes.
fn read_footer(source: &Source, file: &FileRef) -> Result<(ArrowReaderMetadata, [u8; 32]), DataError> {
    let shown = source.location().file(&file.name);
    let bad = |reason: FooterError| DataError::NotParquet { file: shown.clone(), reason };
    if file.size < 12 {
        return Err(bad(FooterError::TooShort(file.size)));
    }
    let guess = file.size.min(FOOTER_GUESS);
    let tail = source.read(file, file.size - guess..file.size, Purpose::Index)?;
    let last8: [u8; 8] = tail[tail.len() - 8..].try_into().expect("8 bytes");
    let footer = FooterTail::try_new(&last8).map_err(|_| bad(FooterError::NoMagic))?;
    if footer.is_encrypted_footer() {
        return Err(bad(FooterError::Encrypted));
    }
    let len = footer.metadata_length() as u64;
    if len + 8 > file.size {
        return Err(bad(FooterError::TooLong { claims: len, size: file.size }));
    }
    let raw = if len + 8 <= guess {
        tail.slice((guess - 8 - len) as usize..(guess - 8) as usize)
    } else {
        source.read(file, file.size - 8 - len..file.size - 8, Purpose::Index)?
    };
    let meta = decode_footer(&raw).map_err(bad)?;
    Ok((meta, Sha256::digest(&raw).into()))
}

/// A raw footer decoded, with its Arrow schema; or why not (a panic of the decoder included).
fn decode_footer(raw: &[u8]) -> Result<ArrowReaderMetadata, FooterError> {
    let decode = || {
        let meta = ParquetMetaDataReader::decode_metadata(raw).map_err(FooterError::Decode)?;
        ArrowReaderMetadata::try_new(Arc::new(meta), ArrowReaderOptions::new()).map_err(FooterError::Schema)
    };
    std::panic::catch_unwind(decode)
        .unwrap_or_else(|p| Err(FooterError::Panicked(Panicked { message: panic_message(&*p) })))
}

/// Checks every file of `split` against `columns`: what to read of each.
pub fn check(source: &Source, split: &SplitIndex, columns: &Columns) -> Result<Vec<Projection>, DataError> {
    columns.validate().map_err(|(column, reason)| DataError::Declaration {
        file: source.location().to_string(),
        column,
        reason,
    })?;
    split
        .files
        .iter()
        .map(|f| {
            let shown = source.location().file(&f.file.name);
            let projection = schema::check(&shown, f.meta.schema(), f.meta.parquet_schema(), columns)?;
            readable_codecs(&shown, f.meta.metadata(), &projection)?;
            Ok(projection)
        })
        .collect()
}

/// Whether every projected column chunk of the file is compressed with a codec this build
/// reads: a refusal at start, not at the first read of a row group.
fn readable_codecs(file: &str, meta: &ParquetMetaData, projection: &Projection) -> Result<(), DataError> {
    for rg in meta.row_groups() {
        for &leaf in &projection.leaves {
            let chunk = rg.column(leaf);
            if matches!(chunk.compression(), Compression::BROTLI(_) | Compression::LZO) {
                return Err(DataError::Codec {
                    file: file.to_string(),
                    column: chunk.column_path().string(),
                    codec: format!("{:?}", chunk.compression()).split('(').next().unwrap_or("?").to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The fingerprint of a dataset's splits: sha256 of each file's split, name, size and footer.
pub fn fingerprint(splits: &[&SplitIndex]) -> String {
    let mut h = Sha256::new();
    for s in splits {
        for f in &s.files {
            h.update(format!("{}\t{}\t{}\t", s.name, f.file.name, f.file.size));
            h.update(f.footer_sha256);
            h.update(b"\n");
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<FileRef> {
        names.iter().map(|n| FileRef { name: n.to_string(), size: 1, etag: None }).collect()
    }

    #[test]
    fn hugging_face_names_make_the_splits() {
        let all = files(&[
            "README.md",
            "test-00000-of-00001.parquet",
            "train-00000-of-00002.parquet",
            "train-00001-of-00002.parquet",
            "validation-00000-of-00001.parquet",
        ]);
        let names = |s| split_files("loc", &all, s).unwrap().into_iter().map(|f| f.name).collect::<Vec<_>>();
        assert_eq!(names("train"), ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]);
        assert_eq!(names("test"), ["test-00000-of-00001.parquet"]);
        assert_eq!(names("validation"), ["validation-00000-of-00001.parquet"]);
        let single = files(&["train.parquet", "test.parquet", "trainer.parquet"]);
        assert_eq!(split_files("loc", &single, "train").unwrap(), files(&["train.parquet"]));
    }

    proptest::proptest! {
        /// Whatever bytes a footer holds, decoding it is an answer, never a panic.
        #[test]
        fn arbitrary_footers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = decode_footer(&bytes);
        }
    }

    #[test]
    fn a_missing_shard_or_split_is_named() {
        let gap = files(&["train-00000-of-00003.parquet", "train-00002-of-00003.parquet"]);
        assert_eq!(
            split_files("/data/fm", &gap, "train").unwrap_err().to_string(),
            "data location /data/fm: missing train-00001-of-00003.parquet (train has 3 files by its names: 2 found)"
        );
        assert_eq!(
            split_files("/data/fm", &gap, "test").unwrap_err().to_string(),
            "data location /data/fm: no test split: expected test-00000-of-0000N.parquet files (Hugging Face's \
             layout) or test.parquet; found: train-00000-of-00003.parquet, train-00002-of-00003.parquet"
        );
    }
}
