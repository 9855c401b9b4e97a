//! One row group read from the bytes of its projected columns, keeping only the rows a worker
//! wants (a row selection: the others' values are skipped, not built), each row's values taken
//! out of Arrow's arrays as plain [`Value`]s. Image bytes stay encoded until a batch is made.

use std::ops::Range;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;
use bytes::{Buf, Bytes};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ParquetRecordBatchReaderBuilder, RowSelection};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::{ChunkReader, Length};
use trainerd_sdk::{Column, Columns, Decode};

use crate::error::{DataError, GroupError, ValueError};
use crate::schema::{describe, Projection};

/// One row's value, as its column's decoding needs it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// An integer.
    Int(i64),
    /// A number.
    Float(f32),
    /// A list of numbers.
    Floats(Vec<f32>),
    /// A list of integers.
    Ints(Vec<i64>),
    /// Encoded bytes (an image).
    Bytes(Vec<u8>),
    /// A document's text.
    Text(String),
}

impl Value {
    /// Bytes it holds in memory.
    pub fn size(&self) -> usize {
        std::mem::size_of::<Value>()
            + match self {
                Value::Int(_) | Value::Float(_) => 0,
                Value::Floats(v) => v.len() * 4,
                Value::Ints(v) => v.len() * 8,
                Value::Bytes(v) => v.len(),
                Value::Text(t) => t.len(),
            }
    }
}

/// One row: the value of each declared column, in the declaration's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The values.
    pub values: Vec<Value>,
}

impl Row {
    /// Bytes it holds in memory.
    pub fn size(&self) -> usize {
        self.values.iter().map(Value::size).sum()
    }
}

/// The byte range of row group `group` that holds the projected `leaves`.
pub fn byte_range(meta: &ParquetMetaData, group: usize, leaves: &[usize]) -> Range<u64> {
    let rg = meta.row_group(group);
    let ranges = leaves.iter().map(|&leaf| {
        let (start, len) = rg.column(leaf).byte_range();
        start..start + len
    });
    ranges.reduce(|a, b| a.start.min(b.start)..a.end.max(b.end)).unwrap_or(0..0)
}

/// Some bytes of a file, at their place in it: what the reader reads a row group from.
pub struct Chunk {
    /// Where the bytes start in the file.
    pub start: u64,
    /// The bytes.
    pub bytes: Bytes,
    /// The file's length.
    pub file_len: u64,
}

impl Length for Chunk {
    fn len(&self) -> u64 {
        self.file_len
    }
}

impl ChunkReader for Chunk {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        let end = self.start + self.bytes.len() as u64;
        Ok(self.get_bytes(start, end.saturating_sub(start) as usize)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let end = self.start + self.bytes.len() as u64;
        if start < self.start || start + length as u64 > end {
            return Err(parquet::errors::ParquetError::General(format!(
                "the footer points at bytes {start}..{} outside the row group's columns ({}..{end})",
                start + length as u64,
                self.start
            )));
        }
        let at = (start - self.start) as usize;
        Ok(self.bytes.slice(at..at + length))
    }
}

/// Where a row group is: its file (as messages name it) and index, and its first row in the file.
#[derive(Clone, Copy, Debug)]
pub struct Place<'a> {
    /// The file, as messages name it.
    pub file: &'a str,
    /// The row group.
    pub group: usize,
    /// Its first row, counted from the file's first.
    pub first_row: u64,
}

/// The `wanted` rows (ascending, counted from the row group's first) of the row group at
/// `place`, read from `chunk`.
pub fn read(
    place: Place<'_>,
    meta: &ArrowReaderMetadata,
    chunk: Chunk,
    (projection, columns): (&Projection, &Columns),
    wanted: &[u64],
) -> Result<Vec<Row>, DataError> {
    let failed =
        |reason: GroupError| DataError::RowGroup { file: place.file.to_string(), row_group: place.group, reason };
    let group_rows = meta.metadata().row_group(place.group).num_rows() as usize;
    let ranges = consecutive(wanted);
    let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(chunk, meta.clone())
        .with_row_groups(vec![place.group])
        .with_projection(projection.mask(meta.parquet_schema()))
        .with_row_selection(RowSelection::from_consecutive_ranges(ranges.into_iter(), group_rows))
        .with_batch_size(wanted.len().clamp(1, 8192))
        .build()
        .map_err(|e| failed(GroupError::Parquet(e)))?;
    let mut rows = Vec::with_capacity(wanted.len());
    for batch in reader {
        let batch = batch.map_err(|e| failed(GroupError::Arrow(e)))?;
        let array = |c: &Column| {
            batch.column_by_name(&c.name).cloned().ok_or_else(|| failed(GroupError::NoColumn(c.name.clone())))
        };
        let arrays = columns.iter().map(|c| Ok((c, array(c)?))).collect::<Result<Vec<_>, DataError>>()?;
        for i in 0..batch.num_rows() {
            let row = place.first_row + wanted.get(rows.len()).copied().unwrap_or(0);
            let at = |c: &Column, a: &ArrayRef| {
                value(a, i, &c.decode).map_err(|reason| DataError::Row {
                    file: place.file.to_string(),
                    row_group: place.group,
                    row,
                    column: c.name.clone(),
                    reason: Box::new(reason),
                })
            };
            rows.push(Row { values: arrays.iter().map(|(c, a)| at(c, a)).collect::<Result<_, _>>()? });
        }
    }
    if rows.len() != wanted.len() {
        return Err(failed(GroupError::Count { read: rows.len(), selected: wanted.len() }));
    }
    Ok(rows)
}

/// Ascending rows as ranges of consecutive ones.
fn consecutive(rows: &[u64]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for &r in rows {
        let r = r as usize;
        match out.last_mut() {
            Some(last) if last.end == r => last.end += 1,
            _ => out.push(r..r + 1),
        }
    }
    out
}

/// Row `i` of `a`, decoded as `decode` asks.
fn value(a: &ArrayRef, i: usize, decode: &Decode) -> Result<Value, ValueError> {
    if let Decode::Text { .. } = decode {
        // A null document is an empty one.
        return Ok(Value::Text(if a.is_null(i) { String::new() } else { text_at(a, i)?.to_string() }));
    }
    if a.is_null(i) {
        return Err(ValueError::Null);
    }
    Ok(match decode {
        Decode::Integer => Value::Int(int_at(a.as_ref(), i)?),
        Decode::Number => Value::Float(float_at(a.as_ref(), i)?),
        Decode::Numbers { shape } => {
            let list = list_at(a, i)?;
            let floats = (0..list.len()).map(|j| float_at(list.as_ref(), j)).collect::<Result<Vec<_>, _>>()?;
            if floats.len() != decode.numel() {
                return Err(ValueError::Length { found: floats.len(), expected: decode.numel(), shape: shape.clone() });
            }
            Value::Floats(floats)
        }
        Decode::Tokens { .. } => {
            let list = list_at(a, i)?;
            Value::Ints((0..list.len()).map(|j| int_at(list.as_ref(), j)).collect::<Result<_, _>>()?)
        }
        Decode::Image { .. } => Value::Bytes(binary_at(a, i)?.to_vec()),
        Decode::Text { .. } => unreachable!("read above"),
    })
}

fn text_at(a: &ArrayRef, i: usize) -> Result<&str, ValueError> {
    match a.data_type() {
        DataType::Utf8 => Ok(a.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Ok(a.as_string::<i64>().value(i)),
        DataType::Utf8View => Ok(a.as_string_view().value(i)),
        t => Err(ValueError::Type { expected: "a string", found: describe(t) }),
    }
}

fn list_at(a: &ArrayRef, i: usize) -> Result<ArrayRef, ValueError> {
    match a.data_type() {
        DataType::List(_) => Ok(a.as_list::<i32>().value(i)),
        DataType::LargeList(_) => Ok(a.as_list::<i64>().value(i)),
        DataType::FixedSizeList(..) => Ok(a.as_fixed_size_list().value(i)),
        t => Err(ValueError::Type { expected: "a list", found: describe(t) }),
    }
}

fn binary_at(a: &ArrayRef, i: usize) -> Result<&[u8], ValueError> {
    match a.data_type() {
        DataType::Binary => Ok(a.as_binary::<i32>().value(i)),
        DataType::LargeBinary => Ok(a.as_binary::<i64>().value(i)),
        DataType::BinaryView => Ok(a.as_binary_view().value(i)),
        DataType::Struct(_) => {
            let bytes = a.as_struct().column_by_name("bytes").ok_or(ValueError::NoImageBytes)?;
            if bytes.is_null(i) {
                return Err(ValueError::NullImageBytes);
            }
            binary_at(bytes, i)
        }
        t => Err(ValueError::Type { expected: "bytes", found: describe(t) }),
    }
}

fn int_at(a: &dyn Array, i: usize) -> Result<i64, ValueError> {
    if a.is_null(i) {
        return Err(ValueError::NullElement(i));
    }
    let wide = |v: u64| i64::try_from(v).map_err(|_| ValueError::TooLarge(v));
    Ok(match a.data_type() {
        DataType::Int8 => i64::from(a.as_primitive::<Int8Type>().value(i)),
        DataType::Int16 => i64::from(a.as_primitive::<Int16Type>().value(i)),
        DataType::Int32 => i64::from(a.as_primitive::<Int32Type>().value(i)),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i),
        DataType::UInt8 => i64::from(a.as_primitive::<UInt8Type>().value(i)),
        DataType::UInt16 => i64::from(a.as_primitive::<UInt16Type>().value(i)),
        DataType::UInt32 => i64::from(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt64 => wide(a.as_primitive::<UInt64Type>().value(i))?,
        t => return Err(ValueError::Type { expected: "an integer", found: describe(t) }),
    })
}

fn float_at(a: &dyn Array, i: usize) -> Result<f32, ValueError> {
    if a.is_null(i) {
        return Err(ValueError::NullElement(i));
    }
    Ok(match a.data_type() {
        DataType::Float16 => a.as_primitive::<Float16Type>().value(i).to_f32(),
        DataType::Float32 => a.as_primitive::<Float32Type>().value(i),
        DataType::Float64 => a.as_primitive::<Float64Type>().value(i) as f32,
        t if t.is_integer() => int_at(a, i)? as f32,
        t => return Err(ValueError::Type { expected: "a number", found: describe(t) }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_coalesce_into_ranges() {
        assert_eq!(consecutive(&[0, 1, 2, 5, 7, 8]), [0..3, 5..6, 7..9]);
        assert!(consecutive(&[]).is_empty());
    }
}
