//! A dataset's images: PNG and JPEG decoded to 8-bit pixels, PNG encoded for `trainerd data
//! convert`; and what is wrong with one row's value ([`ValueError`], images' faults among them). The decoders are the ones the `image` crate wraps (png, zune-jpeg), used directly
//! with its settings: the rest of `image` (colour management, a dozen other formats) was 40 s of
//! the first build for nothing the data path reads.

use std::io::Cursor;

/// An image's format, as its first bytes tell (the formats `image` recognises, so that an image
/// of another kind is named in the error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImageFormat {
    /// PNG.
    Png,
    /// JPEG.
    Jpeg,
    /// GIF.
    Gif,
    /// WebP.
    WebP,
    /// TIFF.
    Tiff,
    /// DirectDraw Surface.
    Dds,
    /// BMP.
    Bmp,
    /// ICO.
    Ico,
    /// Radiance HDR.
    Hdr,
    /// AVIF.
    Avif,
    /// OpenEXR.
    OpenExr,
    /// QOI.
    Qoi,
    /// PNM (PBM, PGM, PPM, PAM).
    Pnm,
    /// Farbfeld.
    Farbfeld,
}

/// First bytes, the bits of them compared (empty: all), and the format they mark.
const MAGIC: [(&[u8], &[u8], ImageFormat); 16] = [
    (b"\x89PNG\r\n\x1a\n", b"", ImageFormat::Png),
    (&[0xff, 0xd8, 0xff], b"", ImageFormat::Jpeg),
    (b"GIF89a", b"", ImageFormat::Gif),
    (b"GIF87a", b"", ImageFormat::Gif),
    (b"RIFF\0\0\0\0WEBP", b"\xFF\xFF\xFF\xFF\0\0\0\0", ImageFormat::WebP),
    (b"MM\x00*", b"", ImageFormat::Tiff),
    (b"II*\x00", b"", ImageFormat::Tiff),
    (b"DDS ", b"", ImageFormat::Dds),
    (b"BM", b"", ImageFormat::Bmp),
    (&[0, 0, 1, 0], b"", ImageFormat::Ico),
    (b"#?RADIANCE", b"", ImageFormat::Hdr),
    (b"\0\0\0\0ftypavif", b"\xFF\xFF\0\0", ImageFormat::Avif),
    (&[0x76, 0x2f, 0x31, 0x01], b"", ImageFormat::OpenExr),
    (b"qoif", b"", ImageFormat::Qoi),
    (b"P", b"", ImageFormat::Pnm),
    (b"farbfeld", b"", ImageFormat::Farbfeld),
];

/// The format `bytes` begin with, if any.
pub fn guess_format(bytes: &[u8]) -> Option<ImageFormat> {
    MAGIC.iter().find_map(|&(magic, mask, format)| {
        if bytes.len() < magic.len() {
            return None;
        }
        let fits = if mask.is_empty() {
            bytes.starts_with(magic)
        } else {
            magic.iter().zip(mask).zip(bytes).all(|((m, k), b)| (b & k) == (m & k))
        };
        // PNM: "P1" to "P7".
        let fits = fits && (format != ImageFormat::Pnm || bytes.get(1).is_some_and(|b| (b'1'..=b'7').contains(b)));
        fits.then_some(format)
    })
}

/// Decodes a PNG or JPEG image to 8-bit samples, interleaved (height, width, channels), after
/// checking from its header that it is `(c, h, w)` (channels, height, width): an image of another
/// size is refused before its pixels are decoded. PNG's palettes and low bit depths are expanded (a
/// palette to RGB, or RGBA where it has transparency), 16-bit samples rounded to the nearest 8-bit
/// value.
pub fn decode(encoded: &[u8], (c, h, w): (usize, usize, usize)) -> Result<Vec<u8>, ValueError> {
    let check = |found: (usize, usize, usize)| match found == (c, h, w) {
        true => Ok(()),
        false => Err(ValueError::ImageSize { found, expected: (c, h, w) }),
    };
    match guess_format(encoded).ok_or(ValueError::NotAnImage)? {
        ImageFormat::Png => decode_png(encoded, check),
        ImageFormat::Jpeg => decode_jpeg(encoded, check),
        other => Err(ValueError::ImageFormat(other)),
    }
}

fn decode_png(
    encoded: &[u8],
    check: impl FnOnce((usize, usize, usize)) -> Result<(), ValueError>,
) -> Result<Vec<u8>, ValueError> {
    let damaged = |source| ValueError::DamagedImage { format: ImageFormat::Png, source };
    let mut decoder = png::Decoder::new(Cursor::new(encoded));
    decoder.set_transformations(png::Transformations::EXPAND);
    let mut reader = decoder.read_info().map_err(|e| damaged(DecodeError::Png(e)))?;
    let (color, depth) = reader.output_color_type();
    let (width, height) = (reader.info().width as usize, reader.info().height as usize);
    let channels = color.samples();
    check((channels, height, width))?;
    let size = reader.output_buffer_size().ok_or(damaged(DecodeError::PngTooLarge))?;
    let mut buf = vec![0; size];
    reader.next_frame(&mut buf).map_err(|e| damaged(DecodeError::Png(e)))?;
    Ok(match depth {
        // Big-endian 16-bit samples to the nearest 8-bit value (as `image` converts them).
        png::BitDepth::Sixteen => {
            buf.chunks_exact(2).map(|b| ((u32::from(u16::from_be_bytes([b[0], b[1]])) + 128) / 257) as u8).collect()
        }
        _ => {
            buf.truncate(channels * height * width);
            buf
        }
    })
}

fn decode_jpeg(
    encoded: &[u8],
    check: impl FnOnce((usize, usize, usize)) -> Result<(), ValueError>,
) -> Result<Vec<u8>, ValueError> {
    use zune_core::colorspace::ColorSpace;
    let damaged = |e| ValueError::DamagedImage { format: ImageFormat::Jpeg, source: DecodeError::Jpeg(e) };
    // `image`'s settings: lenient, no size limit of the decoder's own (the size is checked here).
    let options = zune_core::options::DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(zune_core::bytestream::ZCursor::new(encoded), options);
    decoder.decode_headers().map_err(damaged)?;
    let (width, height) = decoder.dimensions().expect("the headers are decoded");
    let input = decoder.input_colorspace().expect("the headers are decoded");
    // Greyscale and RGB(A) as they are; YCbCr, CMYK and YCCK as RGB.
    let output = match input {
        ColorSpace::RGB | ColorSpace::RGBA | ColorSpace::Luma | ColorSpace::LumaA => input,
        _ => ColorSpace::RGB,
    };
    decoder.set_options(decoder.options().jpeg_set_out_colorspace(output));
    check((output.num_components(), height, width))?;
    decoder.decode().map_err(damaged)
}

/// A lossless 8-bit greyscale PNG of `pixels`, `h` x `w` (`image`'s default settings: fast
/// compression, adaptive filtering).
pub fn encode_grey_png(pixels: &[u8], (h, w): (u32, u32)) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Grayscale);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Fast);
    encoder.set_filter(png::Filter::Adaptive);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(pixels)?;
    writer.finish()?;
    Ok(out)
}

/// What is wrong with one row's value, for the plugin's declaration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValueError {
    /// A null value.
    #[error("the value is null")]
    Null,
    /// A null element of a list.
    #[error("element {0} is null")]
    NullElement(usize),
    /// An unsigned integer beyond int64.
    #[error("{0} does not fit an int64")]
    TooLarge(u64),
    /// A list of another length than the declared shape's.
    #[error("a list of {found} numbers, the plugin expects {expected} (shape {shape:?})")]
    Length {
        /// Its length.
        found: usize,
        /// The shape's size.
        expected: usize,
        /// The declared shape.
        shape: Vec<i64>,
    },
    /// A value of another type than the declaration reads (the type as the schema shows it).
    #[error("expected {expected}, found {found}")]
    Type {
        /// What the declaration reads ("a list", "an integer", "a number", "bytes").
        expected: &'static str,
        /// The column's type.
        found: String,
    },
    /// Hugging Face's image struct without its bytes.
    #[error("the image struct has no `bytes`")]
    NoImageBytes,
    /// Hugging Face's image struct with null bytes.
    #[error("the image's `bytes` is null")]
    NullImageBytes,
    /// A value that cannot be decoded as the declaration says.
    #[error("{value} cannot be decoded as {expects}")]
    Mismatch {
        /// The value, shortened.
        value: String,
        /// What the declaration reads.
        expects: String,
    },
    /// Bytes that are no image.
    #[error("not a PNG or JPEG image")]
    NotAnImage,
    /// An image of another format.
    #[error("a {0:?} image: expected PNG or JPEG")]
    ImageFormat(ImageFormat),
    /// A damaged image.
    #[error("a damaged {format:?} image: {source}")]
    DamagedImage {
        /// Its format.
        format: ImageFormat,
        /// What the decoder said.
        source: DecodeError,
    },
    /// An image of another size or channel count than declared.
    #[error(
        "a {}x{} image with {} channel(s); the plugin expects {}x{} with {} (images are not resized or converted)",
        found.2, found.1, found.0, expected.2, expected.1, expected.0
    )]
    ImageSize {
        /// Its (channels, height, width).
        found: (usize, usize, usize),
        /// The declared (channels, height, width).
        expected: (usize, usize, usize),
    },
    /// The batch's tensor could not be shaped.
    #[error("{0}")]
    Torch(#[source] trainerd_sdk::tch::TchError),
}

/// What an image's decoder said of it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The PNG decoder's error.
    #[error("{0}")]
    Png(#[source] png::DecodingError),
    /// A PNG whose pixels would not fit in memory's addresses.
    #[error("its pixels would not fit in memory")]
    PngTooLarge,
    /// The JPEG decoder's error.
    #[error("{0}")]
    Jpeg(#[source] zune_jpeg::errors::DecodeErrors),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_told_by_their_first_bytes() {
        assert_eq!(guess_format(b"\x89PNG\r\n\x1a\n...."), Some(ImageFormat::Png));
        assert_eq!(guess_format(&[0xff, 0xd8, 0xff, 0xe0]), Some(ImageFormat::Jpeg));
        assert_eq!(guess_format(b"GIF89a...."), Some(ImageFormat::Gif));
        assert_eq!(guess_format(b"RIFF\x10\0\0\0WEBPVP8 "), Some(ImageFormat::WebP));
        assert_eq!(guess_format(b"P5 28 28 255"), Some(ImageFormat::Pnm));
        assert_eq!(guess_format(b"Parquet"), None);
        assert_eq!(guess_format(b"nothing"), None);
        assert_eq!(guess_format(b""), None);
    }

    #[test]
    fn a_png_round_trips_and_its_size_is_checked_before_decoding() {
        let pixels: Vec<u8> = (0..6).map(|v| v * 40).collect();
        let png = encode_grey_png(&pixels, (2, 3)).unwrap();
        assert_eq!(decode(&png, (1, 2, 3)).unwrap(), pixels);
        assert_eq!(
            decode(&png, (3, 2, 3)).unwrap_err().to_string(),
            "a 3x2 image with 1 channel(s); the plugin expects 3x2 with 3 (images are not resized or converted)"
        );
    }

    #[test]
    fn sixteen_bit_samples_round_to_the_nearest_eight_bit_value() {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, 3, 1);
        encoder.set_color(png::ColorType::Grayscale);
        encoder.set_depth(png::BitDepth::Sixteen);
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(&[0, 0, 0x80, 0x7f, 0xff, 0xff]).unwrap();
        writer.finish().unwrap();
        // 0x807f / 257 = 127.99..., rounded: 128.
        assert_eq!(decode(&out, (1, 1, 3)).unwrap(), [0, 128, 255]);
    }

    #[test]
    fn grey_and_alpha_keeps_its_two_channels() {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, 2, 1);
        encoder.set_color(png::ColorType::GrayscaleAlpha);
        let mut writer = encoder.write_header().unwrap();
        writer.write_image_data(&[10, 255, 20, 0]).unwrap();
        writer.finish().unwrap();
        assert_eq!(decode(&out, (2, 1, 2)).unwrap(), [10, 255, 20, 0]);
    }

    #[test]
    fn a_damaged_image_names_its_format_and_the_decoder_s_reason() {
        let png = encode_grey_png(&[0; 4], (2, 2)).unwrap();
        let message = decode(&png[..png.len() - 20], (1, 2, 2)).unwrap_err().to_string();
        assert!(message.starts_with("a damaged Png image: "), "{message}");
        let message = decode(&[0xff, 0xd8, 0xff, 0xe0, 0, 0], (3, 2, 2)).unwrap_err().to_string();
        assert!(message.starts_with("a damaged Jpeg image: "), "{message}");
        assert_eq!(decode(b"GIF89a....", (1, 2, 2)).unwrap_err().to_string(), "a Gif image: expected PNG or JPEG");
    }
}
