//! `trainerd predict`'s output: one Parquet file of a model's outputs per example, as Keras's
//! `model.predict` returns them. Two columns: `example` (int64, the example's number in its
//! split: files in name order, rows in file order, from 0) and `output` (the example's outputs,
//! float32, flattened row-major into a fixed-size list). The schema's metadata `trainerd.shape`
//! says one example's shape (`128,512`), so `np.array(output).reshape(shape)` gives it back.
//!
//! The file is written to a temporary name beside its path and renamed when complete: a reader
//! sees the whole file or none.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

pub use crate::error::WriteError;

/// The schema metadata key of one example's shape.
pub const SHAPE_KEY: &str = "trainerd.shape";

/// A predictions file being written.
pub struct Writer {
    path: PathBuf,
    partial: PathBuf,
    shape: Vec<i64>,
    schema: Arc<Schema>,
    writer: ArrowWriter<File>,
    rows: u64,
}

impl Writer {
    /// Starts `path` for outputs of `shape` per example.
    pub fn create(path: &Path, shape: &[i64]) -> Result<Writer, WriteError> {
        let per_example = shape.iter().product::<i64>().max(0) as i32;
        let item = Arc::new(Field::new("item", DataType::Float32, false));
        let text = shape.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let schema = Arc::new(Schema::new_with_metadata(
            vec![
                Field::new("example", DataType::Int64, false),
                Field::new("output", DataType::FixedSizeList(item, per_example), false),
            ],
            std::collections::HashMap::from([(SHAPE_KEY.to_string(), text)]),
        ));
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let partial = path.with_file_name(format!(".{name}.partial"));
        let file = File::create(&partial).map_err(WriteError::Io)?;
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let writer = ArrowWriter::try_new(file, Arc::clone(&schema), Some(props)).map_err(WriteError::Parquet)?;
        Ok(Writer { path: path.to_path_buf(), partial, shape: shape.to_vec(), schema, writer, rows: 0 })
    }

    /// One example's shape.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Appends the examples `ids` with their outputs, `values` (`ids.len()` times the shape's
    /// size, row-major).
    pub fn write(&mut self, ids: &[i64], values: Vec<f32>) -> Result<(), WriteError> {
        let Some(DataType::FixedSizeList(item, per_example)) = self.schema.fields().get(1).map(|f| f.data_type())
        else {
            unreachable!("the schema's second column is a fixed-size list")
        };
        let outputs =
            FixedSizeListArray::try_new(Arc::clone(item), *per_example, Arc::new(Float32Array::from(values)), None)
                .map_err(WriteError::Arrow)?;
        let columns: Vec<ArrayRef> = vec![Arc::new(Int64Array::from(ids.to_vec())), Arc::new(outputs)];
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns).map_err(WriteError::Arrow)?;
        self.writer.write(&batch).map_err(WriteError::Parquet)?;
        self.rows += ids.len() as u64;
        Ok(())
    }

    /// Examples written.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Finishes the file and puts it at its path.
    pub fn finish(self) -> Result<u64, WriteError> {
        let file = self.writer.into_inner().map_err(WriteError::Parquet)?;
        file.sync_all().map_err(WriteError::Io)?;
        std::fs::rename(&self.partial, &self.path).map_err(WriteError::Io)?;
        Ok(self.rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Array;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    #[test]
    fn outputs_read_back_with_their_shape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.parquet");
        let mut w = Writer::create(&path, &[2, 3]).unwrap();
        w.write(&[4, 7], (0..12).map(|v| v as f32).collect()).unwrap();
        assert!(!path.exists(), "nothing at the path before it is finished");
        assert_eq!(w.finish().unwrap(), 2);
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap();
        assert_eq!(builder.schema().metadata()[SHAPE_KEY], "2,3");
        let batch = builder.build().unwrap().next().unwrap().unwrap();
        let ids = batch.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!(ids.values(), &[4, 7]);
        let out = batch.column(1).as_any().downcast_ref::<FixedSizeListArray>().unwrap();
        let second = out.value(1);
        let second = second.as_any().downcast_ref::<Float32Array>().unwrap();
        assert_eq!(second.values(), &[6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
    }
}
