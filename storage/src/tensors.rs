//! Tensors as plain bytes (the host-memory snapshot a checkpoint is made of) and their
//! safetensors encoding, so that a Python user opens a checkpoint with the `safetensors`
//! package.
//!
//! Encoding streams: the header is computed from the tensors' shapes, then each tensor's bytes
//! follow as they are, so a blob is never assembled in a second buffer. Decoding uses the
//! `safetensors` crate, which validates the format.

use bytes::Bytes;
use serde::Serialize;

/// Element types a checkpoint holds, with their safetensors names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Unsigned byte.
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U8 => 1,
        }
    }

    fn from_safetensors(d: safetensors::Dtype) -> Option<Dtype> {
        Some(match d {
            safetensors::Dtype::F32 => Dtype::F32,
            safetensors::Dtype::F64 => Dtype::F64,
            safetensors::Dtype::F16 => Dtype::F16,
            safetensors::Dtype::BF16 => Dtype::BF16,
            safetensors::Dtype::I64 => Dtype::I64,
            safetensors::Dtype::I32 => Dtype::I32,
            safetensors::Dtype::U8 => Dtype::U8,
            _ => return None,
        })
    }
}

/// One tensor in host memory: name, type, shape and little-endian contiguous bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorData {
    /// Name (unique within its blob).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// `product(shape) * dtype.size()` bytes.
    pub data: Bytes,
}

/// A malformed tensor or blob.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// A tensor's byte count does not match its shape.
    #[error("tensor {name}: {bytes} bytes, but shape {shape:?} of {dtype:?} needs {expected}")]
    Size {
        /// Tensor name.
        name: String,
        /// Bytes given.
        bytes: usize,
        /// Shape.
        shape: Vec<usize>,
        /// Type.
        dtype: Dtype,
        /// Bytes needed.
        expected: usize,
    },
    /// Two tensors share a name.
    #[error("tensor {0} appears twice")]
    Duplicate(String),
    /// Not a valid safetensors file.
    #[error("not a valid safetensors blob: {0}")]
    Format(String),
}

#[derive(Serialize)]
struct HeaderEntry<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    data_offsets: [usize; 2],
}

/// The safetensors encoding of `tensors` (sorted by name) as a sequence of byte chunks: the
/// header, then each tensor's data without copying it.
pub fn encode(tensors: &[TensorData]) -> Result<Vec<Bytes>, TensorError> {
    for t in tensors {
        let expected = t.shape.iter().product::<usize>() * t.dtype.size();
        if t.data.len() != expected {
            return Err(TensorError::Size {
                name: t.name.clone(),
                bytes: t.data.len(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                expected,
            });
        }
    }
    let entries: Vec<(&str, Dtype, &[usize])> =
        tensors.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice())).collect();
    let (head, order) = header(&entries)?;
    let mut chunks = vec![Bytes::from(head)];
    chunks.extend(order.iter().map(|&i| tensors[i].data.clone()));
    Ok(chunks)
}

/// The first bytes of the safetensors encoding of tensors named, typed and shaped as `entries`
/// (the header's length, then the header), and the order, by name, in which their data follows.
/// What [`encode`] writes before the data, for a writer that streams the data itself.
pub fn header(entries: &[(&str, Dtype, &[usize])]) -> Result<(Vec<u8>, Vec<usize>), TensorError> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| entries[a].0.cmp(entries[b].0));
    let mut json = serde_json::Map::new();
    let mut offset = 0;
    for (k, &i) in order.iter().enumerate() {
        let (name, dtype, shape) = entries[i];
        if k > 0 && entries[order[k - 1]].0 == name {
            return Err(TensorError::Duplicate(name.to_string()));
        }
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let entry = HeaderEntry { dtype, shape, data_offsets: [offset, offset + bytes] };
        json.insert(name.to_string(), serde_json::to_value(entry).expect("plain data"));
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&json).expect("plain data");
    // The reference implementation pads the header with spaces to a multiple of 8 bytes.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&json);
    Ok((head, order))
}

/// One tensor's place in a safetensors blob: name, type, shape, and its data's bytes, counted
/// from the blob's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its bytes in the blob.
    pub bytes: std::ops::Range<usize>,
}

#[derive(serde::Deserialize)]
struct ReadEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// The largest header [`layout`] reads (the `safetensors` crate's own bound).
const MAX_HEADER: usize = 100_000_000;

/// Where each tensor of a safetensors blob of `len` bytes lies, read from its first bytes `head`
/// alone: for a reader that puts each tensor's data in place as it arrives, never holding the
/// blob. The tensors in data order, or `None` while `head` does not hold the whole header yet.
/// The same checks as [`decode`]'s: the data tile the blob's rest, each as long as its shape.
pub fn layout(head: &[u8], len: usize) -> Result<Option<Vec<Placed>>, TensorError> {
    let bad = |what: String| Err(TensorError::Format(what));
    let Some(n) = head.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize) else {
        return Ok(None);
    };
    if n > MAX_HEADER || 8 + n > len {
        return bad(format!("a header of {n} bytes in a blob of {len}"));
    }
    let Some(json) = head.get(8..8 + n) else { return Ok(None) };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| TensorError::Format(format!("the header: {e}")))?;
    let mut placed = Vec::with_capacity(map.len());
    for (name, value) in map.into_iter().filter(|(name, _)| name != "__metadata__") {
        let e: ReadEntry =
            serde_json::from_value(value).map_err(|e| TensorError::Format(format!("tensor {name}: {e}")))?;
        let [from, to] = e.data_offsets;
        let expected = e.shape.iter().product::<usize>() * e.dtype.size();
        if to < from || to - from != expected {
            return Err(TensorError::Size {
                name,
                bytes: to.saturating_sub(from),
                shape: e.shape,
                dtype: e.dtype,
                expected,
            });
        }
        placed.push(Placed { name, dtype: e.dtype, shape: e.shape, bytes: 8 + n + from..8 + n + to });
    }
    placed.sort_by_key(|p| p.bytes.start);
    let mut at = 8 + n;
    for p in &placed {
        if p.bytes.start != at {
            return bad(format!("tensor {}'s data starts at byte {}, expected {at}", p.name, p.bytes.start));
        }
        at = p.bytes.end;
    }
    if at != len {
        return bad(format!("the tensors end at byte {at}, the blob at {len}"));
    }
    Ok(Some(placed))
}

/// Decodes a safetensors blob (validated by the `safetensors` crate), tensors sorted by name.
pub fn decode(blob: &Bytes) -> Result<Vec<TensorData>, TensorError> {
    let st = safetensors::SafeTensors::deserialize(blob).map_err(|e| TensorError::Format(e.to_string()))?;
    let base = blob.as_ptr() as usize;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = Dtype::from_safetensors(view.dtype())
            .ok_or_else(|| TensorError::Format(format!("tensor {name}: unsupported dtype {:?}", view.dtype())))?;
        let data = view.data();
        let start = data.as_ptr() as usize - base;
        out.push(TensorData { name, dtype, shape: view.shape().to_vec(), data: blob.slice(start..start + data.len()) });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tensor(name: &str, shape: &[usize], fill: u8) -> TensorData {
        let n: usize = shape.iter().product::<usize>() * 4;
        TensorData { name: name.into(), dtype: Dtype::F32, shape: shape.to_vec(), data: Bytes::from(vec![fill; n]) }
    }

    fn concat(chunks: Vec<Bytes>) -> Bytes {
        Bytes::from(chunks.iter().flat_map(|c| c.iter().copied()).collect::<Vec<u8>>())
    }

    #[test]
    fn a_blobs_layout_is_read_from_its_header_alone() {
        let ts = vec![tensor("b", &[2, 3], 1), tensor("a", &[4], 2), tensor("scalar", &[], 3)];
        let blob = concat(encode(&ts).unwrap());
        let n = 8 + u64::from_le_bytes(blob[..8].try_into().unwrap()) as usize;
        assert_eq!(layout(&blob[..n - 1], blob.len()).unwrap(), None, "the header not whole yet");
        let placed = layout(&blob[..n], blob.len()).unwrap().expect("the header is whole");
        let names: Vec<&str> = placed.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "scalar"]);
        for (p, t) in placed.iter().zip(decode(&blob).unwrap()) {
            assert_eq!((&p.shape, p.dtype, &blob[p.bytes.clone()]), (&t.shape, t.dtype, &t.data[..]));
        }
        let err = layout(&blob[..n], blob.len() + 4).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "not a valid safetensors blob: the tensors end at byte {}, the blob at {}",
                blob.len(),
                blob.len() + 4
            )
        );
    }

    #[test]
    fn round_trip_and_errors() {
        let ts = vec![tensor("b", &[2, 3], 1), tensor("a", &[4], 2), tensor("scalar", &[], 3)];
        let blob = concat(encode(&ts).unwrap());
        let back = decode(&blob).unwrap();
        let mut expected = ts.clone();
        expected.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, expected);
        assert_eq!(u64::from_le_bytes(blob[..8].try_into().unwrap()) % 8, 0);

        let mut bad = tensor("x", &[2], 0);
        bad.data = Bytes::from_static(&[0; 3]);
        assert_eq!(encode(&[bad]).unwrap_err().to_string(), "tensor x: 3 bytes, but shape [2] of F32 needs 8");
        assert_eq!(
            encode(&[tensor("x", &[1], 0), tensor("x", &[1], 0)]).unwrap_err().to_string(),
            "tensor x appears twice"
        );
        assert!(decode(&Bytes::from_static(b"garbage!")).is_err());
    }

    proptest! {
        #[test]
        fn any_tensors_round_trip(shapes in proptest::collection::vec(proptest::collection::vec(0usize..5, 0..4), 0..6)) {
            let ts: Vec<TensorData> = shapes.iter().enumerate().map(|(i, s)| tensor(&format!("t{i}"), s, i as u8)).collect();
            let back = decode(&concat(encode(&ts).unwrap())).unwrap();
            prop_assert_eq!(back, ts);
        }
    }
}
