//! How a record of a columnar dataset (Parquet, as Hugging Face Datasets, pandas, Polars, Spark
//! and DuckDB write it) becomes the tensors a model takes: which column is the input, which the
//! label, and how each is decoded. A plugin declares this ([`crate::PluginInfo::columns`]); the
//! daemon reads, checks and decodes the files, so a plugin holds no reader and every plugin
//! gets the same streaming, ordering and failure handling.
//!
//! A dataset whose schema does not fit the declaration is refused before training, naming the
//! file, the column, what was expected and what was found.

use serde::{Deserialize, Serialize};

/// The columns a model trains on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Columns {
    /// The model's input (what `forward` receives, batched).
    pub input: Column,
    /// The label (what `loss` and `metrics` receive, batched).
    pub label: Column,
}

/// One column and its decoding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Column {
    /// The column's name in the files' schema.
    pub name: String,
    /// How each row's value becomes a tensor.
    pub decode: Decode,
}

/// How one row's value becomes a tensor (a batch stacks them along a new first dimension).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decode {
    /// One integer (any integer type): int64, shape `[]`. Class labels.
    Integer,
    /// One number (any integer or floating type): float32, shape `[]`. Regression targets.
    Number,
    /// A list of numbers (fixed-size or variable list of any numeric type): float32 of `shape`,
    /// whose product must be the list's length.
    Numbers {
        /// The tensor's shape per row.
        shape: Vec<i64>,
    },
    /// An encoded image (PNG or JPEG) in a binary column or in Hugging Face's image struct
    /// (`struct<bytes: binary, path: string>`): float32 `[channels, height, width]`, each pixel
    /// divided by 255 (as MNIST's idx loader does). Images are not resized: one of another size
    /// is an error naming it.
    Image {
        /// 1 (grey), 3 (RGB) or 4 (RGBA).
        channels: u32,
        /// Rows of pixels.
        height: u32,
        /// Pixels per row.
        width: u32,
    },
    /// A list of integer token ids: int64 `[length]`, a shorter list padded with `pad` at its
    /// end, a longer one cut at the `truncate` side.
    Tokens {
        /// Tokens per row.
        length: u32,
        /// The id that pads a short row.
        pad: i64,
        /// Which end of a long row is cut.
        truncate: Side,
    },
}

/// An end of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The first tokens go (the last `length` are kept).
    Left,
    /// The last tokens go (the first `length` are kept).
    Right,
}

impl Columns {
    /// An image classifier's columns in Hugging Face's layout: the image struct `image` decoded to
    /// `[channels, height, width]`, the integer class `label`.
    pub fn image_classification(channels: u32, height: u32, width: u32) -> Columns {
        Columns {
            input: Column { name: "image".into(), decode: Decode::Image { channels, height, width } },
            label: Column { name: "label".into(), decode: Decode::Integer },
        }
    }
}

impl Decode {
    /// The shape of one row's tensor.
    pub fn shape(&self) -> Vec<i64> {
        match self {
            Decode::Integer | Decode::Number => Vec::new(),
            Decode::Numbers { shape } => shape.clone(),
            Decode::Image { channels, height, width } => {
                vec![i64::from(*channels), i64::from(*height), i64::from(*width)]
            }
            Decode::Tokens { length, .. } => vec![i64::from(*length)],
        }
    }

    /// Values per row.
    pub fn numel(&self) -> usize {
        self.shape().iter().product::<i64>().max(0) as usize
    }

    /// What the column must hold, as messages say it.
    pub fn expects(&self) -> String {
        match self {
            Decode::Integer => "an integer".into(),
            Decode::Number => "a number".into(),
            Decode::Numbers { shape } => format!("a list of {} numbers (shape {shape:?})", self.numel()),
            Decode::Image { .. } => "PNG or JPEG bytes (binary, or struct<bytes: binary, path: string>)".into(),
            Decode::Tokens { .. } => "a list of integer token ids".into(),
        }
    }

    /// Whether the declaration itself makes sense (a shape with no zero or negative dimension, a
    /// known channel count, a positive length); the plugin's error otherwise.
    pub fn validate(&self) -> Result<(), DeclarationError> {
        match self {
            Decode::Numbers { shape } if shape.iter().any(|&d| d <= 0) => {
                Err(DeclarationError::Shape { shape: shape.clone() })
            }
            Decode::Image { channels, .. } if ![1, 3, 4].contains(channels) => {
                Err(DeclarationError::Channels { channels: *channels })
            }
            Decode::Image { height, width, .. } if *height == 0 || *width == 0 => {
                Err(DeclarationError::ImageSize { width: *width, height: *height })
            }
            Decode::Tokens { length: 0, .. } => Err(DeclarationError::TokenLength),
            _ => Ok(()),
        }
    }
}

/// A column declaration that makes no sense.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeclarationError {
    /// A shape with a dimension that is not positive.
    #[error("shape {shape:?} has a dimension that is not positive")]
    Shape {
        /// The shape.
        shape: Vec<i64>,
    },
    /// An image channel count other than 1, 3 or 4.
    #[error("{channels} image channels: expected 1, 3 or 4")]
    Channels {
        /// The count.
        channels: u32,
    },
    /// An image with no pixels.
    #[error("an image of {width}x{height} pixels: expected both sides at least 1")]
    ImageSize {
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
    },
    /// Token lists of no tokens.
    #[error("a token length of 0: expected at least 1")]
    TokenLength,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The declaration crosses the plugin boundary as JSON: its form is part of the ABI.
    #[test]
    fn the_json_form_is_stable() {
        let c = Columns::image_classification(1, 28, 28);
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"input":{"name":"image","decode":{"kind":"image","channels":1,"height":28,"width":28}},"label":{"name":"label","decode":{"kind":"integer"}}}"#
        );
        let t = Decode::Tokens { length: 8, pad: 0, truncate: Side::Left };
        assert_eq!(serde_json::to_string(&t).unwrap(), r#"{"kind":"tokens","length":8,"pad":0,"truncate":"left"}"#);
        assert_eq!(t.shape(), [8]);
        assert_eq!(Decode::Image { channels: 3, height: 2, width: 5 }.shape(), [3, 2, 5]);
        assert_eq!(Decode::Integer.shape(), Vec::<i64>::new());
    }

    #[test]
    fn bad_declarations_say_why() {
        assert_eq!(
            Decode::Image { channels: 2, height: 1, width: 1 }.validate().unwrap_err().to_string(),
            "2 image channels: expected 1, 3 or 4"
        );
        assert!(Decode::Numbers { shape: vec![3, 0] }.validate().is_err());
        assert!(Decode::Numbers { shape: vec![3, 4] }.validate().is_ok());
    }
}
