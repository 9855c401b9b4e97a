//! Reader for the MNIST idx format (MNIST, Fashion-MNIST, KMNIST...), gzipped or plain.
//!
//! A split is two files in one directory: `{train,t10k}-images-idx3-ubyte` and
//! `{train,t10k}-labels-idx1-ubyte`, each optionally with `.gz`. Every error names the file and
//! what was expected, because the operator's only fix is to repair that file.

use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::abi::InputContext;
pub use crate::error::DataError;
use crate::error::PluginError;
use crate::model::{Pipeline, Split};

/// Magic number of an idx3 unsigned-byte file (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an idx1 unsigned-byte file (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// One split held in memory, compact: pixels stay bytes until a batch is drawn
/// ([`Mnist::pipeline`]).
#[derive(Debug)]
pub struct Mnist {
    /// Pixels as stored, `[n, 1, rows, cols]`, uint8.
    pub images: Tensor,
    /// Labels, `[n]`, int64.
    pub labels: Tensor,
}

impl Mnist {
    /// Loads `split` from `dir`.
    pub fn load(dir: &Path, split: Split) -> Result<Mnist, DataError> {
        let prefix = match split {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        let (images_path, images) = read_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
        let (labels_path, labels) = read_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;

        let img = parse_idx(&images_path, &images, IMAGES_MAGIC, 3, "idx3 images")?;
        let lab = parse_idx(&labels_path, &labels, LABELS_MAGIC, 1, "idx1 labels")?;
        if img.dims[0] != lab.dims[0] {
            return Err(DataError::CountMismatch {
                images: images_path,
                n_images: img.dims[0],
                labels: labels_path,
                n_labels: lab.dims[0],
            });
        }
        let (n, rows, cols) = (i64::from(img.dims[0]), i64::from(img.dims[1]), i64::from(img.dims[2]));
        let images = Tensor::from_slice(img.data).view([n, 1, rows, cols]);
        let labels = Tensor::from_slice(lab.data).to_kind(Kind::Int64);
        Ok(Mnist { images, labels })
    }

    /// The input pipeline of `ctx` over this split: batches of float images in [0, 1] (column
    /// `image`, `[batch, 1, rows, cols]`) and int64 labels (column `label`), converted batch by
    /// batch: the batches a Parquet dataset of [`crate::Columns::image_classification`] gives.
    pub fn pipeline(&self, ctx: &InputContext) -> Result<Pipeline, PluginError> {
        crate::data::sharded_map(
            (&self.images, &self.labels),
            ctx,
            ("image", |x: Tensor| x.f_to_kind(Kind::Float)?.f_div_scalar(255.0)),
        )
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.size()[0] as usize
    }

    /// True when the split has no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The batch's input, checked to be 28x28 single-channel images (`[batch, 1, 28, 28]`), the input
/// every MNIST-format model takes; the error names `plugin` and what it got.
pub fn expect_images<'b>(plugin: &str, batch: &'b crate::Batch) -> Result<&'b Tensor, PluginError> {
    let xs = batch.input()?;
    let shape = xs.size();
    if shape.len() != 4 || shape[1..] != [1, 28, 28] {
        return Err(PluginError::Other(format!("{plugin} expects images of shape [batch, 1, 28, 28], got {shape:?}")));
    }
    Ok(xs)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// Reads `dir/name.gz` (decompressed) or `dir/name`.
fn read_file(dir: &Path, name: &str) -> Result<(PathBuf, Vec<u8>), DataError> {
    let gz = dir.join(format!("{name}.gz"));
    let plain = dir.join(name);
    if gz.is_file() {
        let compressed = std::fs::read(&gz).map_err(io(&gz))?;
        if let Some(bytes) = crate::inflated::cached(&compressed) {
            return Ok((gz, bytes));
        }
        let bytes = match inflate_whole(&compressed) {
            Some(bytes) => bytes,
            None => {
                let mut bytes = Vec::new();
                flate2::read::MultiGzDecoder::new(compressed.as_slice()).read_to_end(&mut bytes).map_err(io(&gz))?;
                bytes
            }
        };
        crate::inflated::keep(&compressed, &bytes);
        Ok((gz, bytes))
    } else if plain.is_file() {
        let bytes = std::fs::read(&plain).map_err(io(&plain))?;
        Ok((plain, bytes))
    } else {
        Err(DataError::MissingFile { dir: dir.to_path_buf(), name: name.to_string() })
    }
}

/// A single-member gzip file inflated in one call by libdeflate, its size taken from the trailer;
/// `None` when that does not fit (several members, over 4 GiB, damage): the caller streams it
/// instead, and reports any error with the file's name.
fn inflate_whole(gz: &[u8]) -> Option<Vec<u8>> {
    let size = u32::from_le_bytes(gz.get(gz.len().checked_sub(4)?..)?.try_into().ok()?) as usize;
    let mut out = vec![0u8; size];
    let got = libdeflater::Decompressor::new().gzip_decompress(gz, &mut out).ok()?;
    (got == size).then_some(out)
}

struct Idx<'a> {
    dims: Vec<u32>,
    data: &'a [u8],
}

/// Parses an unsigned-byte idx file: a big-endian magic, one big-endian u32 per dimension, then
/// the data.
fn parse_idx<'a>(
    path: &Path,
    bytes: &'a [u8],
    magic: u32,
    ndims: usize,
    what: &'static str,
) -> Result<Idx<'a>, DataError> {
    let header_len = 4 + 4 * ndims;
    let word = |i: usize| u32::from_be_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    if bytes.len() < 4 {
        return Err(DataError::Truncated { path: path.into(), expected: header_len as u64, found: bytes.len() as u64 });
    }
    let found = word(0);
    if found != magic {
        return Err(DataError::BadMagic { path: path.into(), found, expected: magic, what });
    }
    if bytes.len() < header_len {
        return Err(DataError::Truncated { path: path.into(), expected: header_len as u64, found: bytes.len() as u64 });
    }
    let dims: Vec<u32> = (1..=ndims).map(word).collect();
    // Three u32 dimensions can overflow u64: such a header promises more than any file holds.
    let expected = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d))).unwrap_or(u64::MAX);
    let data = &bytes[header_len..];
    if (data.len() as u64) < expected {
        return Err(DataError::Truncated { path: path.into(), expected, found: data.len() as u64 });
    }
    Ok(Idx { dims, data: &data[..expected as usize] })
}

/// Writes an idx file (plain, or gzipped when `path` ends in `.gz`): for tests and tools that
/// make small datasets.
pub fn write_idx(path: &Path, magic: u32, dims: &[u32], data: &[u8]) -> std::io::Result<()> {
    let mut bytes = magic.to_be_bytes().to_vec();
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    if path.extension().is_some_and(|e| e == "gz") {
        let file = std::fs::File::create(path)?;
        let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
        std::io::Write::write_all(&mut enc, &bytes)?;
        enc.finish()?;
        Ok(())
    } else {
        std::fs::write(path, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_split(dir: &Path, prefix: &str, n: u32, gz: bool) {
        let ext = if gz { ".gz" } else { "" };
        let images: Vec<u8> = (0..n * 4).map(|i| (i % 256) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        write_idx(&dir.join(format!("{prefix}-images-idx3-ubyte{ext}")), IMAGES_MAGIC, &[n, 2, 2], &images).unwrap();
        write_idx(&dir.join(format!("{prefix}-labels-idx1-ubyte{ext}")), LABELS_MAGIC, &[n], &labels).unwrap();
    }

    #[test]
    fn reads_gzipped_and_plain() {
        for gz in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            write_split(dir.path(), "train", 5, gz);
            let m = Mnist::load(dir.path(), Split::Train).unwrap();
            assert_eq!(m.images.size(), [5, 1, 2, 2]);
            assert_eq!(m.len(), 5);
            assert_eq!(Vec::<i64>::try_from(&m.labels).unwrap(), [0, 1, 2, 3, 4]);
            assert_eq!(m.images.kind(), Kind::Uint8, "pixels stay compact in memory");
            assert_eq!(m.images.int64_value(&[1, 0, 0, 1]), 5);
            let ctx = InputContext {
                num_input_pipelines: 1,
                input_pipeline_id: 0,
                per_replica_batch_size: 5,
                training: false,
                epoch: 0,
                seed: 0,
                first_step: 0,
            };
            let batch = m.pipeline(&ctx).unwrap().batches.next().unwrap().unwrap();
            let xs = batch.column("image").unwrap();
            assert_eq!(xs.kind(), Kind::Float);
            assert_eq!(xs.double_value(&[1, 0, 0, 1]), f64::from(5.0f32 / 255.0));
        }
    }

    #[test]
    fn missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_split(dir.path(), "train", 5, true);
        std::fs::remove_file(dir.path().join("train-labels-idx1-ubyte.gz")).unwrap();
        let err = Mnist::load(dir.path(), Split::Train).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "data directory {}: missing train-labels-idx1-ubyte (or train-labels-idx1-ubyte.gz)",
                dir.path().display()
            )
        );
    }

    #[test]
    fn count_mismatch_names_both_files() {
        let dir = tempfile::tempdir().unwrap();
        write_split(dir.path(), "t10k", 5, false);
        write_idx(&dir.path().join("t10k-labels-idx1-ubyte"), LABELS_MAGIC, &[4], &[0; 4]).unwrap();
        let err = Mnist::load(dir.path(), Split::Test).unwrap_err().to_string();
        let d = dir.path().display();
        assert_eq!(err, format!("{d}/t10k-images-idx3-ubyte: 5 images, but {d}/t10k-labels-idx1-ubyte: 4 labels"));
    }

    #[test]
    fn corrupt_gzip_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write_split(dir.path(), "train", 5, true);
        let p = dir.path().join("train-images-idx3-ubyte.gz");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
        let err = Mnist::load(dir.path(), Split::Train).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: ", p.display())), "{err}");
    }

    proptest::proptest! {
        /// Whatever bytes a file holds, the reader returns an error or data, never panics.
        #[test]
        fn arbitrary_bytes_never_panic(
            with_magic: bool,
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let mut bytes = if with_magic { IMAGES_MAGIC.to_be_bytes().to_vec() } else { Vec::new() };
            bytes.extend(tail);
            let _ = parse_idx(Path::new("f"), &bytes, IMAGES_MAGIC, 3, "idx3 images");
        }
    }
}
