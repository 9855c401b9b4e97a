//! A file's columns checked against what a plugin declares, before any training: each declared
//! column must exist with a type its decoding can read. The result says which leaves of the file
//! to read (only the declared columns; only `bytes` of Hugging Face's image struct).

use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ProjectionMask;
use parquet::schema::types::SchemaDescriptor;
use trainerd_sdk::{Column, Columns, Decode};

use crate::error::DataError;

/// What to read of a file: the leaves (Parquet's leaf column indices) of the declared columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Projection {
    /// Leaf column indices, ascending.
    pub leaves: Vec<usize>,
}

impl Projection {
    /// The mask the reader takes.
    pub fn mask(&self, schema: &SchemaDescriptor) -> ProjectionMask {
        ProjectionMask::leaves(schema, self.leaves.iter().copied())
    }
}

/// Checks `columns` against the file's `schema` (its Arrow form) and `parquet` schema; what to
/// read of it. `file` names it in errors.
pub fn check(
    file: &str,
    schema: &Schema,
    parquet: &SchemaDescriptor,
    columns: &Columns,
) -> Result<Projection, DataError> {
    let mut leaves = Vec::new();
    for column in columns.iter() {
        let field = find(file, schema, column)?;
        fits(&column.decode, field.data_type()).map_err(|()| DataError::Schema {
            file: file.to_string(),
            column: column.name.clone(),
            expected: column.decode.expects(),
            found: describe(field.data_type()),
        })?;
        let image_struct =
            matches!(column.decode, Decode::Image { .. }) && matches!(field.data_type(), DataType::Struct(_));
        for (i, leaf) in parquet.columns().iter().enumerate() {
            let parts = leaf.path().parts();
            if parts[0] == column.name && (!image_struct || parts.get(1).is_some_and(|p| p == "bytes")) {
                leaves.push(i);
            }
        }
    }
    leaves.sort_unstable();
    leaves.dedup();
    Ok(Projection { leaves })
}

fn find<'s>(file: &str, schema: &'s Schema, column: &Column) -> Result<&'s Field, DataError> {
    schema.field_with_name(&column.name).map_err(|_| DataError::MissingColumn {
        file: file.to_string(),
        column: column.name.clone(),
        expected: column.decode.expects(),
        available: schema
            .fields()
            .iter()
            .map(|f| format!("{} ({})", f.name(), describe(f.data_type())))
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Whether a column of type `t` can be decoded as `decode`.
fn fits(decode: &Decode, t: &DataType) -> Result<(), ()> {
    let ok = match decode {
        Decode::Integer => t.is_integer(),
        Decode::Number => t.is_integer() || t.is_floating(),
        Decode::Numbers { .. } => match t {
            DataType::FixedSizeList(item, n) => {
                (item.data_type().is_integer() || item.data_type().is_floating()) && *n as usize == decode.numel()
            }
            DataType::List(item) | DataType::LargeList(item) => {
                item.data_type().is_integer() || item.data_type().is_floating()
            }
            _ => false,
        },
        Decode::Image { .. } => match t {
            DataType::Struct(fields) => fields.iter().any(|f| f.name() == "bytes" && is_binary(f.data_type())),
            other => is_binary(other),
        },
        Decode::Text { .. } => matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View),
        Decode::Tokens { .. } => match t {
            DataType::FixedSizeList(item, _) | DataType::List(item) | DataType::LargeList(item) => {
                item.data_type().is_integer()
            }
            _ => false,
        },
    };
    if ok {
        Ok(())
    } else {
        Err(())
    }
}

fn is_binary(t: &DataType) -> bool {
    matches!(t, DataType::Binary | DataType::LargeBinary | DataType::BinaryView)
}

/// A type as Arrow's users write it: `int64`, `struct<bytes: binary, path: string>`,
/// `fixed_size_list<float>[784]`.
pub fn describe(t: &DataType) -> String {
    match t {
        DataType::Int8 => "int8".into(),
        DataType::Int16 => "int16".into(),
        DataType::Int32 => "int32".into(),
        DataType::Int64 => "int64".into(),
        DataType::UInt8 => "uint8".into(),
        DataType::UInt16 => "uint16".into(),
        DataType::UInt32 => "uint32".into(),
        DataType::UInt64 => "uint64".into(),
        DataType::Float16 => "halffloat".into(),
        DataType::Float32 => "float".into(),
        DataType::Float64 => "double".into(),
        DataType::Boolean => "bool".into(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => "binary".into(),
        DataType::List(item) | DataType::LargeList(item) => format!("list<{}>", describe(item.data_type())),
        DataType::FixedSizeList(item, n) => format!("fixed_size_list<{}>[{n}]", describe(item.data_type())),
        DataType::Struct(fields) => format!(
            "struct<{}>",
            fields.iter().map(|f| format!("{}: {}", f.name(), describe(f.data_type()))).collect::<Vec<_>>().join(", ")
        ),
        other => other.to_string().to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow_schema::Fields;
    use parquet::arrow::ArrowSchemaConverter;

    fn hf_image() -> Schema {
        let image = DataType::Struct(Fields::from(vec![
            Field::new("bytes", DataType::Binary, true),
            Field::new("path", DataType::Utf8, true),
        ]));
        Schema::new(vec![Field::new("image", image, true), Field::new("label", DataType::Int64, true)])
    }

    fn checked(schema: &Schema, columns: &Columns) -> Result<Projection, DataError> {
        let parquet = ArrowSchemaConverter::new().convert(schema).unwrap();
        check("f.parquet", schema, &parquet, columns)
    }

    #[test]
    fn hugging_face_images_read_only_their_bytes() {
        let p = checked(&hf_image(), &Columns::image_classification(1, 28, 28)).unwrap();
        assert_eq!(p.leaves, [0, 2], "image.bytes and label, not image.path");
    }

    #[test]
    fn a_missing_column_lists_what_the_file_has() {
        let mut columns = Columns::image_classification(1, 28, 28);
        columns.0[1].name = "class".into();
        assert_eq!(
            checked(&hf_image(), &columns).unwrap_err().to_string(),
            "data file f.parquet: no column `class` (the plugin reads it as an integer); the file has: image \
             (struct<bytes: binary, path: string>), label (int64)"
        );
    }

    #[test]
    fn a_wrong_type_names_what_was_expected_and_found() {
        let schema =
            Schema::new(vec![Field::new("image", DataType::Int64, true), Field::new("label", DataType::Float32, true)]);
        assert_eq!(
            checked(&schema, &Columns::image_classification(1, 28, 28)).unwrap_err().to_string(),
            "data file f.parquet: column `image`: expected PNG or JPEG bytes (binary, or struct<bytes: binary, \
             path: string>), found int64"
        );
        let pixels = Field::new(
            "pixels",
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), 100),
            true,
        );
        let schema = Schema::new(vec![pixels, Field::new("label", DataType::Int32, true)]);
        let columns = Columns(vec![
            Column { name: "pixels".into(), decode: Decode::Numbers { shape: vec![1, 28, 28] } },
            Column { name: "label".into(), decode: Decode::Integer },
        ]);
        assert_eq!(
            checked(&schema, &columns).unwrap_err().to_string(),
            "data file f.parquet: column `pixels`: expected a list of 784 numbers (shape [1, 28, 28]), found \
             fixed_size_list<float>[100]"
        );
    }
}
