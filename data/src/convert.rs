//! `trainerd data convert`: an MNIST-format directory (MNIST, Fashion-MNIST: idx files) written
//! as Parquet in Hugging Face's layout, so that any tool that reads Hugging Face's `fashion_mnist`
//! reads it, and trainerd trains from it exactly as from the idx files.
//!
//! Each split becomes `{split}-{i:05d}-of-{n:05d}.parquet` files with two columns: `image`
//! (`struct<bytes: binary, path: string>`: a lossless greyscale PNG, no path) and `label`
//! (int64), rows in the idx files' order, snappy-compressed as `datasets.Dataset.to_parquet`
//! writes them, with Hugging Face's feature metadata (so `datasets` decodes `image` as an image).

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, BinaryArray, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Fields, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use rayon::prelude::*;
use trainerd_sdk::mnist::Mnist;
use trainerd_sdk::Split;
use trainerd_storage::S3Options;

use crate::error::{DataError, WriteError};
use crate::index::split_name;
use crate::location::DataLocation;
use crate::source::{Quiet, Source};

/// How the rows are cut into files and row groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sharding {
    /// Rows per file (the last file holds the rest).
    pub rows_per_file: usize,
    /// Rows per row group (Hugging Face writes image datasets in row groups of 100 rows).
    pub rows_per_group: usize,
}

/// What was written of a split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// The split.
    pub split: Split,
    /// Its files.
    pub files: Vec<String>,
    /// Rows.
    pub rows: usize,
    /// Bytes of its files.
    pub bytes: u64,
}

/// Writes the MNIST-format directory `from` to `to` as Parquet; `progress` is told (split, rows
/// done, rows in all) after each file.
pub fn mnist(
    from: &Path,
    to: &DataLocation,
    s3: &S3Options,
    sharding: Sharding,
    progress: &mut dyn FnMut(Split, usize, usize),
) -> Result<Vec<Written>, DataError> {
    if let DataLocation::Local(dir) = to {
        std::fs::create_dir_all(dir)
            .map_err(|e| DataError::Write { what: dir.display().to_string(), reason: WriteError::Io(e) })?;
    }
    let sink = Source::open(to, s3, std::time::Duration::from_secs(60), None, Arc::new(Quiet))?;
    let mut written = Vec::new();
    for split in [Split::Train, Split::Test] {
        let data = Mnist::load(from, split)
            .map_err(|e| DataError::Write { what: from.display().to_string(), reason: WriteError::Mnist(e) })?;
        let (n, (h, w), pixels, labels) = raw(&data)?;
        let files = n.div_ceil(sharding.rows_per_file.max(1)).max(1);
        let mut out = Written { split, files: Vec::new(), rows: n, bytes: 0 };
        for i in 0..files {
            let rows = i * sharding.rows_per_file..((i + 1) * sharding.rows_per_file).min(n);
            let name = format!("{}-{i:05}-of-{files:05}.parquet", split_name(split));
            let bytes = file((&pixels, (h, w)), &labels, rows.clone(), sharding.rows_per_group)
                .map_err(|reason| DataError::Write { what: to.file(&name), reason })?;
            out.bytes += bytes.len() as u64;
            sink.write(&name, bytes.into())?;
            out.files.push(name);
            progress(split, rows.end, n);
        }
        written.push(out);
    }
    Ok(written)
}

/// Pixels of images `height` x `width`.
type Images<'a> = (&'a [Vec<u8>], (u32, u32));

/// (rows, (height, width), each row's pixels, labels) of a split.
#[allow(clippy::type_complexity)]
fn raw(data: &Mnist) -> Result<(usize, (u32, u32), Vec<Vec<u8>>, Vec<i64>), DataError> {
    let size = data.images.size();
    let (h, w) = (size[2] as u32, size[3] as u32);
    let flat = Vec::<u8>::try_from(data.images.flatten(0, -1))?;
    let labels = Vec::<i64>::try_from(&data.labels)?;
    let pixels = flat.chunks_exact(((h * w) as usize).max(1)).map(<[u8]>::to_vec).collect();
    Ok((data.len(), (h, w), pixels, labels))
}

/// Hugging Face's schema for an image classification dataset.
fn schema() -> Arc<Schema> {
    let image = DataType::Struct(image_fields());
    let features =
        r#"{"info": {"features": {"image": {"_type": "Image"}, "label": {"dtype": "int64", "_type": "Value"}}}}"#;
    let metadata: std::collections::HashMap<String, String> =
        [("huggingface".to_string(), features.to_string())].into();
    Arc::new(Schema::new_with_metadata(
        vec![Field::new("image", image, true), Field::new("label", DataType::Int64, true)],
        metadata,
    ))
}

fn image_fields() -> Fields {
    Fields::from(vec![Field::new("bytes", DataType::Binary, true), Field::new("path", DataType::Utf8, true)])
}

/// One Parquet file of `rows` of the split: its bytes.
fn file(
    (pixels, (h, w)): Images<'_>,
    labels: &[i64],
    rows: std::ops::Range<usize>,
    per_group: usize,
) -> Result<Vec<u8>, WriteError> {
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(per_group.max(1)))
        .build();
    let mut writer = ArrowWriter::try_new(Vec::new(), schema(), Some(props)).map_err(WriteError::Parquet)?;
    for start in rows.clone().step_by(per_group.max(1)) {
        let group = start..(start + per_group.max(1)).min(rows.end);
        let pngs: Vec<Vec<u8>> = pixels[group.clone()].par_iter().map(|p| png(p, (h, w))).collect::<Result<_, _>>()?;
        let bytes: ArrayRef = Arc::new(BinaryArray::from_iter_values(pngs.iter()));
        let paths: ArrayRef = Arc::new(StringArray::new_null(group.len()));
        let image: ArrayRef = Arc::new(StructArray::new(image_fields(), vec![bytes, paths], None));
        let label: ArrayRef = Arc::new(Int64Array::from(labels[group].to_vec()));
        let batch = RecordBatch::try_new(schema(), vec![image, label]).map_err(WriteError::Arrow)?;
        writer.write(&batch).map_err(WriteError::Parquet)?;
    }
    writer.into_inner().map_err(WriteError::Parquet)
}

/// A lossless greyscale PNG of an image `h` x `w`.
fn png(pixels: &[u8], (h, w): (u32, u32)) -> Result<Vec<u8>, WriteError> {
    crate::codec::encode_grey_png(pixels, (h, w)).map_err(WriteError::Png)
}
