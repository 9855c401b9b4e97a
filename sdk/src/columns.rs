//! How a record of a columnar dataset (Parquet, as Hugging Face Datasets, pandas, Polars, Spark
//! and DuckDB write it) becomes the tensors a model takes: which columns it reads, and how each is
//! decoded into the batch's column of the same name. A plugin declares this ([`crate::PluginInfo::columns`]); the
//! daemon reads, checks and decodes the files, so a plugin holds no reader and every plugin
//! gets the same streaming, ordering and failure handling.
//!
//! A dataset whose schema does not fit the declaration is refused before training, naming the
//! file, the column, what was expected and what was found.

use serde::{Deserialize, Serialize};

/// The columns a model trains on, in the order its batches hold them. A dataset may have no label
/// column: examples are counted along the first dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Columns(pub Vec<Column>);

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
    /// Raw text, tokenized and packed by the daemon: each document of the dataset's text column
    /// (`text`, or the daemon's `--text-column`) is tokenized by the run's tokenizer and followed
    /// by its end-of-text token, the split's documents are concatenated in file order, and the
    /// stream is cut into blocks of `length` tokens (the last partial one dropped). Each example is
    /// one block: int64 `[length]` under this column's name, and the same ids under `labels`,
    /// which a language model shifts itself. It must be the only column declared.
    Text {
        /// Tokens per block.
        length: u32,
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
        Columns(vec![
            Column { name: "image".into(), decode: Decode::Image { channels, height, width } },
            Column { name: crate::LABEL.into(), decode: Decode::Integer },
        ])
    }

    /// The columns, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Column> {
        self.0.iter()
    }

    /// The column named `name`.
    pub fn get(&self, name: &str) -> Option<&Column> {
        self.0.iter().find(|c| c.name == name)
    }

    /// The token column whose padding the batch's [`crate::ATTENTION_MASK`] is derived from: the
    /// first token column, when the dataset does not declare the mask itself.
    pub fn masked_tokens(&self) -> Option<&Column> {
        if self.get(crate::ATTENTION_MASK).is_some() {
            return None;
        }
        self.0.iter().find(|c| matches!(c.decode, Decode::Tokens { .. }))
    }

    /// Tokens per example: the declared length of the first token column, if any.
    pub fn tokens_per_example(&self) -> Option<u32> {
        self.0.iter().find_map(|c| match c.decode {
            Decode::Tokens { length, .. } | Decode::Text { length } => Some(length),
            _ => None,
        })
    }

    /// The packed text column ([`Decode::Text`]) and its block length, when it is declared.
    pub fn packed_text(&self) -> Option<(&str, u32)> {
        self.0.iter().find_map(|c| match c.decode {
            Decode::Text { length } => Some((c.name.as_str(), length)),
            _ => None,
        })
    }

    /// Checks the declaration: at least one column, no name twice, each decoding sensible, a text
    /// column alone. The error names the column.
    pub fn validate(&self) -> Result<(), (String, DeclarationError)> {
        if self.0.is_empty() {
            return Err((String::new(), DeclarationError::NoColumns));
        }
        if let (Some((name, _)), true) = (self.packed_text(), self.0.len() > 1) {
            return Err((name.to_string(), DeclarationError::TextAlone));
        }
        for (i, c) in self.0.iter().enumerate() {
            if self.0[..i].iter().any(|d| d.name == c.name) {
                return Err((c.name.clone(), DeclarationError::Twice));
            }
            c.decode.validate().map_err(|e| (c.name.clone(), e))?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Decode {
    type Err = DeclarationError;

    /// A decoding as users spell it: `integer`, `number`, `numbers:N` (or `numbers:AxB`),
    /// `tokens:LEN` (padded with 0 at the end, cut at the end), `image:CxHxW`.
    fn from_str(spec: &str) -> Result<Decode, DeclarationError> {
        let bad = || DeclarationError::Spelling { spec: spec.to_string() };
        let (kind, size) = match spec.trim().split_once(':') {
            Some((k, s)) => (k.trim(), Some(s.trim())),
            None => (spec.trim(), None),
        };
        let dims = |s: Option<&str>| -> Result<Vec<i64>, DeclarationError> {
            let s = s.ok_or_else(bad)?;
            s.split('x').map(|d| d.trim().parse::<i64>().map_err(|_| bad())).collect()
        };
        let decode = match kind {
            "integer" if size.is_none() => Decode::Integer,
            "number" if size.is_none() => Decode::Number,
            "numbers" => Decode::Numbers { shape: dims(size)? },
            "tokens" => {
                let length = size.and_then(|s| s.parse::<u32>().ok()).ok_or_else(bad)?;
                Decode::Tokens { length, pad: 0, truncate: Side::Right }
            }
            "text" => Decode::Text { length: size.and_then(|s| s.parse::<u32>().ok()).ok_or_else(bad)? },
            "image" => match dims(size)?.as_slice() {
                &[c, h, w] if c >= 0 && h >= 0 && w >= 0 => {
                    Decode::Image { channels: c as u32, height: h as u32, width: w as u32 }
                }
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        };
        decode.validate()?;
        Ok(decode)
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
            Decode::Tokens { length, .. } | Decode::Text { length } => vec![i64::from(*length)],
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
            Decode::Text { .. } => "text (a string column of documents)".into(),
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
            Decode::Tokens { length: 0, .. } | Decode::Text { length: 0 } => Err(DeclarationError::TokenLength),
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
    /// A declaration of no columns.
    #[error("no columns are declared: expected at least one")]
    NoColumns,
    /// A column declared twice.
    #[error("the column is declared twice")]
    Twice,
    /// A packed text column declared beside others.
    #[error(
        "a text column is the only column: its blocks are the examples, and their labels the same ids (declare the \
         other columns in another model)"
    )]
    TextAlone,
    /// A decoding spelled in no known way.
    #[error(
        "{spec:?} is not a column kind: expected integer, number, numbers:N (or numbers:AxB), tokens:LEN, text:LEN or \
         image:CxHxW (such as image:1x28x28)"
    )]
    Spelling {
        /// What was written.
        spec: String,
    },
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
            r#"[{"name":"image","decode":{"kind":"image","channels":1,"height":28,"width":28}},{"name":"label","decode":{"kind":"integer"}}]"#
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

    #[test]
    fn kinds_are_spelled_as_users_write_them() {
        assert_eq!("integer".parse::<Decode>().unwrap(), Decode::Integer);
        assert_eq!("number".parse::<Decode>().unwrap(), Decode::Number);
        assert_eq!("numbers:4".parse::<Decode>().unwrap(), Decode::Numbers { shape: vec![4] });
        assert_eq!("numbers:2x3".parse::<Decode>().unwrap(), Decode::Numbers { shape: vec![2, 3] });
        assert_eq!(
            "tokens:128".parse::<Decode>().unwrap(),
            Decode::Tokens { length: 128, pad: 0, truncate: Side::Right }
        );
        assert_eq!("image:3x32x32".parse::<Decode>().unwrap(), Decode::Image { channels: 3, height: 32, width: 32 });
        assert_eq!(
            "tokens".parse::<Decode>().unwrap_err().to_string(),
            "\"tokens\" is not a column kind: expected integer, number, numbers:N (or numbers:AxB), tokens:LEN, text:LEN \
             or image:CxHxW (such as image:1x28x28)"
        );
        assert_eq!("tokens:0".parse::<Decode>().unwrap_err(), DeclarationError::TokenLength);
        assert_eq!("text:256".parse::<Decode>().unwrap(), Decode::Text { length: 256 });
        assert_eq!("text:0".parse::<Decode>().unwrap_err(), DeclarationError::TokenLength);
        // Raw text is the only column: its blocks are the examples, their labels the same ids.
        let both = Columns(vec![
            Column { name: "input_ids".into(), decode: Decode::Text { length: 8 } },
            Column { name: crate::LABEL.into(), decode: Decode::Integer },
        ]);
        assert_eq!(both.validate(), Err(("input_ids".into(), DeclarationError::TextAlone)));
        assert_eq!(both.packed_text(), Some(("input_ids", 8)));
        assert_eq!(both.tokens_per_example(), Some(8));
        assert_eq!("image:2x1x1".parse::<Decode>().unwrap_err(), DeclarationError::Channels { channels: 2 });
    }

    #[test]
    fn a_derived_mask_follows_the_first_token_column_unless_declared() {
        let tokens = Column { name: "input_ids".into(), decode: "tokens:8".parse().unwrap() };
        let lm = Columns(vec![tokens.clone()]);
        assert_eq!(lm.masked_tokens().map(|c| c.name.as_str()), Some("input_ids"));
        assert_eq!(lm.tokens_per_example(), Some(8));
        let mask = Column { name: crate::ATTENTION_MASK.into(), decode: "tokens:8".parse().unwrap() };
        assert_eq!(Columns(vec![tokens.clone(), mask]).masked_tokens(), None);
        assert_eq!(Columns::image_classification(1, 28, 28).masked_tokens(), None);
        assert_eq!(
            Columns(vec![tokens.clone(), tokens]).validate().unwrap_err(),
            ("input_ids".into(), DeclarationError::Twice)
        );
    }
}
