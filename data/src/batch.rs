//! A batch's tensors from its rows, as the plugin's columns declare: images decoded (PNG or JPEG,
//! in parallel on the loader threads) into `[batch, channels, height, width]` and scaled to
//! [0, 1] exactly as MNIST's idx loader scales its bytes (so both give the same bits), numbers
//! and token lists stacked, token lists padded or cut. No libtorch operator runs here, only
//! tensors made from finished buffers (see [`stack`]'s image case).

use rayon::prelude::*;
use trainerd_sdk::tch::Tensor;
use trainerd_sdk::{Column, Decode, Side};

use crate::codec::ValueError;
use crate::rows::Value;

/// Why a row's value could not become its tensor: the row's index in the batch, and the reason.
pub type Failed = (usize, ValueError);

/// The tensor of `values` (one per row) of `column`.
pub fn stack(values: &[&Value], column: &Column) -> Result<Tensor, Failed> {
    let n = values.len() as i64;
    let mut shape = vec![n];
    shape.extend(column.decode.shape());
    let mismatch =
        |i: usize, v: &Value| (i, ValueError::Mismatch { value: format!("{v:?}"), expects: column.decode.expects() });
    let tensor = match &column.decode {
        Decode::Integer => {
            let ints = values.iter().enumerate().map(|(i, v)| match v {
                Value::Int(x) => Ok(*x),
                other => Err(mismatch(i, other)),
            });
            Tensor::from_slice(&ints.collect::<Result<Vec<i64>, _>>()?)
        }
        Decode::Number => {
            let floats = values.iter().enumerate().map(|(i, v)| match v {
                Value::Float(x) => Ok(*x),
                other => Err(mismatch(i, other)),
            });
            Tensor::from_slice(&floats.collect::<Result<Vec<f32>, _>>()?)
        }
        Decode::Numbers { .. } => {
            let mut out = Vec::with_capacity(values.len() * column.decode.numel());
            for (i, v) in values.iter().enumerate() {
                match v {
                    Value::Floats(x) => out.extend_from_slice(x),
                    other => return Err(mismatch(i, other)),
                }
            }
            Tensor::from_slice(&out)
        }
        Decode::Tokens { length, pad, truncate } => {
            let mut out = Vec::with_capacity(values.len() * *length as usize);
            for (i, v) in values.iter().enumerate() {
                match v {
                    Value::Ints(x) => out.extend(fit(x, *length as usize, *pad, *truncate)),
                    other => return Err(mismatch(i, other)),
                }
            }
            Tensor::from_slice(&out)
        }
        Decode::Image { channels, height, width } => {
            let (c, h, w) = (*channels as usize, *height as usize, *width as usize);
            Tensor::from_slice(&images(values, (c, h, w), &mismatch)?)
        }
        // Packed text has no rows to stack: its batches are blocks (`crate::text::blocks`).
        Decode::Text { .. } => return Err(mismatch(0, values.first().copied().unwrap_or(&Value::Int(0)))),
    };
    tensor.f_view(shape.as_slice()).map_err(|e| (0, ValueError::Torch(e)))
}

/// The pixels of encoded images `values`, each decoded to `(c, h, w)` on the pool, as float32 in
/// [0, 1].
fn images(
    values: &[&Value],
    (c, h, w): (usize, usize, usize),
    mismatch: &(dyn Fn(usize, &Value) -> Failed + Sync),
) -> Result<Vec<f32>, Failed> {
    let mut pixels = vec![0u8; values.len() * c * h * w];
    pixels.par_chunks_mut(c * h * w).zip(values.par_iter()).enumerate().try_for_each(|(i, (out, v))| match v {
        Value::Bytes(encoded) => decode_image(encoded, (c, h, w), out).map_err(|e| (i, e)),
        other => Err(mismatch(i, other)),
    })?;
    // `Mnist::pipeline` divides its bytes as float32 by 255 in libtorch: one correctly rounded
    // IEEE division each, so the same bits. Done here, not by a libtorch op: on a loader thread
    // that would start an OpenMP team of its own (OpenMP's thread count is per thread), whose
    // spinning takes the training threads' cores.
    Ok(pixels.iter().map(|&p| f32::from(p) / 255.0).collect())
}

/// The padding mask of a token column's `values`: int64 `[rows, length]`, 1 where a row has a
/// token and 0 where it was padded (a row cut to `length` is all ones).
pub fn padding_mask(values: &[&Value], decode: &Decode) -> Result<Tensor, Failed> {
    let Decode::Tokens { length, .. } = decode else {
        return Err((
            0,
            ValueError::Mismatch { value: "a column that is not tokens".into(), expects: decode.expects() },
        ));
    };
    let length = *length as usize;
    let mut out = Vec::with_capacity(values.len() * length);
    for (i, v) in values.iter().enumerate() {
        match v {
            Value::Ints(x) => {
                let real = x.len().min(length);
                out.extend(std::iter::repeat_n(1i64, real).chain(std::iter::repeat_n(0, length - real)));
            }
            other => return Err((i, ValueError::Mismatch { value: format!("{other:?}"), expects: decode.expects() })),
        }
    }
    Tensor::from_slice(&out).f_view([values.len() as i64, length as i64]).map_err(|e| (0, ValueError::Torch(e)))
}

/// `tokens` made `length` long: padded with `pad` at the end, or cut at `truncate`'s side.
fn fit(tokens: &[i64], length: usize, pad: i64, truncate: Side) -> impl Iterator<Item = i64> + '_ {
    let kept = match truncate {
        Side::Right => &tokens[..tokens.len().min(length)],
        Side::Left => &tokens[tokens.len().saturating_sub(length)..],
    };
    kept.iter().copied().chain(std::iter::repeat_n(pad, length - kept.len()))
}

/// Decodes a PNG or JPEG image into `out`, channel-major (`[c, h, w]`), checking its size and
/// channels against the declaration.
fn decode_image(encoded: &[u8], (c, h, w): (usize, usize, usize), out: &mut [u8]) -> Result<(), ValueError> {
    let raw = crate::codec::decode(encoded, (c, h, w))?;
    if c == 1 {
        out.copy_from_slice(&raw);
    } else {
        // Interleaved (h, w, c) to channel-major (c, h, w), as a model takes it.
        for (p, px) in raw.chunks_exact(c).enumerate() {
            for (ch, &v) in px.iter().enumerate() {
                out[ch * h * w + p] = v;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, color: png::ColorType, raw: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, w, h);
        encoder.set_color(color);
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(raw).unwrap();
        writer.finish().unwrap();
        out
    }

    #[test]
    fn grey_and_rgb_images_decode_channel_major_and_scaled() {
        let grey = Value::Bytes(png(2, 1, png::ColorType::Grayscale, &[0, 255]));
        let column = Column { name: "image".into(), decode: Decode::Image { channels: 1, height: 1, width: 2 } };
        let t = stack(&[&grey, &grey], &column).unwrap();
        assert_eq!(t.size(), [2, 1, 1, 2]);
        assert_eq!(Vec::<f32>::try_from(t.flatten(0, -1)).unwrap(), [0.0, 1.0, 0.0, 1.0]);
        let rgb = Value::Bytes(png(2, 1, png::ColorType::Rgb, &[1, 2, 3, 4, 5, 6]));
        let column = Column { name: "image".into(), decode: Decode::Image { channels: 3, height: 1, width: 2 } };
        let t = stack(&[&rgb], &column).unwrap();
        let scaled: Vec<f32> = [1u8, 4, 2, 5, 3, 6].iter().map(|&v| f32::from(v) / 255.0).collect();
        assert_eq!(Vec::<f32>::try_from(t.flatten(0, -1)).unwrap(), scaled);
    }

    #[test]
    fn an_image_of_another_size_or_kind_is_named() {
        let column = Column { name: "image".into(), decode: Decode::Image { channels: 1, height: 28, width: 28 } };
        let small = Value::Bytes(png(2, 1, png::ColorType::Grayscale, &[0, 255]));
        let told = |(i, e): Failed| (i, e.to_string());
        assert_eq!(
            told(stack(&[&small], &column).unwrap_err()),
            (
                0,
                "a 2x1 image with 1 channel(s); the plugin expects 28x28 with 1 (images are not resized or converted)"
                    .into()
            )
        );
        let junk = Value::Bytes(b"GIF89a....".to_vec());
        assert_eq!(stack(&[&small, &junk], &column).unwrap_err().0, 0);
        assert_eq!(
            told(stack(&[&Value::Bytes(b"nothing".to_vec())], &column).unwrap_err()),
            (0, "not a PNG or JPEG image".into())
        );
    }

    #[test]
    fn tokens_are_padded_or_cut_at_the_declared_side() {
        let column = |truncate| Column { name: "t".into(), decode: Decode::Tokens { length: 3, pad: -1, truncate } };
        let (short, long) = (Value::Ints(vec![7]), Value::Ints(vec![1, 2, 3, 4, 5]));
        let t = stack(&[&short, &long], &column(Side::Right)).unwrap();
        assert_eq!(Vec::<i64>::try_from(t.flatten(0, -1)).unwrap(), [7, -1, -1, 1, 2, 3]);
        let t = stack(&[&long], &column(Side::Left)).unwrap();
        assert_eq!(Vec::<i64>::try_from(t.flatten(0, -1)).unwrap(), [3, 4, 5]);
        let mask = padding_mask(&[&short, &long], &column(Side::Right).decode).unwrap();
        assert_eq!(mask.size(), [2, 3]);
        assert_eq!(Vec::<i64>::try_from(mask.flatten(0, -1)).unwrap(), [1, 0, 0, 1, 1, 1]);
    }
}
