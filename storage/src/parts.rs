//! Sharded commits' blobs put back together (docs/fault-tolerance.md, "Sharded commits"): a
//! manifest may list a blob as several *parts*, written by different members, each holding
//! element ranges ([`Slice`]) of the blob's tensors, flattened. A reader puts each blob together,
//! and every element of every tensor must be in exactly one slice.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::store::types::{BlobEntry, Slice};
use crate::tensors::{Dtype, TensorData};

/// A tensor being put together from slices: its type and shape, its bytes, and the element
/// ranges written so far (with the part each came from).
struct Assembling {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
    written: Vec<(usize, usize, String)>,
}

/// Each blob of a manifest, from its entries' decoded tensors (in the manifest's order): a whole
/// blob as it was written, a sharded one put together from its parts' slices. Why not, naming the
/// blob, the tensor and the elements, when a slice does not fit, a part misses a tensor its
/// slices name, a blob is both whole and in parts, or elements are in no slice or in two.
pub fn assemble(entries: Vec<(&BlobEntry, Vec<TensorData>)>) -> Result<BTreeMap<String, Vec<TensorData>>, String> {
    let mut whole: BTreeMap<String, Vec<TensorData>> = BTreeMap::new();
    let mut parted: BTreeMap<String, BTreeMap<String, Assembling>> = BTreeMap::new();
    for (entry, mut tensors) in entries {
        let Some(slices) = &entry.slices else {
            tensors.sort_by(|a, b| a.name.cmp(&b.name));
            if whole.insert(entry.name.clone(), tensors).is_some() {
                return Err(format!("blob {} is listed twice", entry.name));
            }
            continue;
        };
        // A part may hold nothing (its member owns no element of the blob's tensors).
        let blob = parted.entry(entry.name.clone()).or_default();
        let stored: BTreeMap<&str, &TensorData> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        for slice in slices {
            let t = stored.get(slice.stored.as_str()).ok_or_else(|| {
                format!(
                    "blob {}: part {} holds no tensor {} (its slice of {})",
                    entry.name, entry.path, slice.stored, slice.tensor
                )
            })?;
            place(blob, slice, t).map_err(|why| format!("blob {}: part {}: {why}", entry.name, entry.path))?;
        }
    }
    for (name, tensors) in parted {
        if whole.contains_key(&name) {
            return Err(format!("blob {name} is listed both whole and in parts"));
        }
        let done = tensors.into_iter().map(|(tensor, a)| covered(tensor, a)).collect::<Result<Vec<_>, _>>();
        whole.insert(name.clone(), done.map_err(|why| format!("blob {name}: {why}"))?);
    }
    Ok(whole)
}

/// Writes the stored tensor `t` of `slice` into the tensor it is a slice of.
fn place(blob: &mut BTreeMap<String, Assembling>, slice: &Slice, t: &TensorData) -> Result<(), String> {
    let len: usize = t.shape.iter().product();
    if t.shape.len() != 1 {
        return Err(format!("{} (a slice of {}) has shape {:?}, not one dimension", t.name, slice.tensor, t.shape));
    }
    let numel: usize = slice.shape.iter().product();
    let a = blob.entry(slice.tensor.clone()).or_insert_with(|| Assembling {
        dtype: t.dtype,
        shape: slice.shape.clone(),
        data: vec![0; numel * t.dtype.size()],
        written: Vec::new(),
    });
    if (a.dtype, &a.shape) != (t.dtype, &slice.shape) {
        return Err(format!(
            "the slice of {} is {:?} of shape {:?}, another is {:?} of shape {:?}",
            slice.tensor, t.dtype, slice.shape, a.dtype, a.shape
        ));
    }
    let end = slice.offset.checked_add(len).filter(|&e| e <= numel).ok_or_else(|| {
        format!(
            "the slice of {} at elements [{}, {}+{len}) is past its {numel} elements",
            slice.tensor, slice.offset, slice.offset
        )
    })?;
    let size = t.dtype.size();
    a.data[slice.offset * size..end * size].copy_from_slice(&t.data);
    a.written.push((slice.offset, end, t.name.clone()));
    Ok(())
}

/// The tensor put together, if its slices cover every element exactly once.
fn covered(name: String, mut a: Assembling) -> Result<TensorData, String> {
    let numel: usize = a.shape.iter().product();
    a.written.sort();
    let mut at = 0;
    for (start, end, _) in &a.written {
        if *start < at {
            return Err(format!("tensor {name}: elements [{start}, {}) are in two parts", at.min(*end)));
        }
        if *start > at {
            return Err(format!("tensor {name}: elements [{at}, {start}) are in no part"));
        }
        at = *end;
    }
    if at < numel {
        return Err(format!("tensor {name}: elements [{at}, {numel}) are in no part"));
    }
    Ok(TensorData { name, dtype: a.dtype, shape: a.shape, data: Bytes::from(a.data) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(name: &str, values: &[f32]) -> TensorData {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorData { name: name.into(), dtype: Dtype::F32, shape: vec![values.len()], data: Bytes::from(data) }
    }

    fn entry(path: &str, slices: Vec<Slice>) -> BlobEntry {
        let name = "optimizer.safetensors".into();
        BlobEntry { name, path: path.into(), size: 0, sha256: String::new(), slices: Some(slices) }
    }

    fn slice(stored: &str, tensor: &str, shape: &[usize], offset: usize) -> Slice {
        Slice { stored: stored.into(), tensor: tensor.into(), shape: shape.to_vec(), offset }
    }

    /// A 2x3 tensor cut at element 4 (across its rows) over two parts, and a vector whole in one,
    /// a third part holding nothing, beside a whole blob: put back together bit for bit, whatever
    /// order the parts come in.
    #[test]
    fn parts_put_together_give_the_whole_tensors() {
        let a = entry("p0", vec![slice("w.0", "w", &[2, 3], 0), slice("b.0", "b", &[2], 0)]);
        let b = entry("p1", vec![slice("w.1", "w", &[2, 3], 4)]);
        let model = BlobEntry {
            name: "model.safetensors".into(),
            path: "m".into(),
            size: 0,
            sha256: String::new(),
            slices: None,
        };
        let empty = entry("p2", vec![]);
        let parts = |order: [usize; 2]| {
            let both = [
                (&a, vec![stored("w.0", &[1.0, 2.0, 3.0, 4.0]), stored("b.0", &[-0.0, 7.5])]),
                (&b, vec![stored("w.1", &[5.0, 6.0])]),
            ];
            let mut out = vec![(&model, vec![stored("x", &[9.0])]), (&empty, vec![])];
            out.extend(order.iter().map(|&i| both[i].clone()));
            assemble(out).unwrap()
        };
        let blobs = parts([0, 1]);
        assert_eq!(blobs, parts([1, 0]));
        let optimizer = &blobs["optimizer.safetensors"];
        let names: Vec<&str> = optimizer.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "w"]);
        let w = &optimizer[1];
        assert_eq!((w.shape.clone(), w.data.clone()), (vec![2, 3], stored("w", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).data));
        assert_eq!(optimizer[0].data, stored("b", &[-0.0, 7.5]).data, "signed zeros kept");
        assert_eq!(blobs["model.safetensors"], vec![stored("x", &[9.0])]);
        // Parts that hold nothing still make their blob (a rule without state: no tensors).
        let nothing = assemble(vec![(&empty, vec![]), (&entry("p3", vec![]), vec![])]).unwrap();
        assert_eq!(nothing, BTreeMap::from([("optimizer.safetensors".to_string(), vec![])]));
    }

    /// Elements in no part, in two, a slice past its tensor's end, and a slice naming a tensor its
    /// part lacks are each named.
    #[test]
    fn a_gap_an_overlap_or_a_slice_that_does_not_fit_is_named() {
        let check = |second: Slice, values: &[f32]| {
            let a = entry("p0", vec![slice("w.0", "w", &[6], 0)]);
            let b = entry("p1", vec![second]);
            let out = vec![(&a, vec![stored("w.0", &[1.0, 2.0, 3.0])]), (&b, vec![stored("w.1", values)])];
            assemble(out).unwrap_err()
        };
        let gap = check(slice("w.1", "w", &[6], 4), &[5.0, 6.0]);
        assert_eq!(gap, "blob optimizer.safetensors: tensor w: elements [3, 4) are in no part");
        let twice = check(slice("w.1", "w", &[6], 2), &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(twice, "blob optimizer.safetensors: tensor w: elements [2, 3) are in two parts");
        let short = check(slice("w.1", "w", &[6], 3), &[5.0, 6.0]);
        assert_eq!(short, "blob optimizer.safetensors: tensor w: elements [5, 6) are in no part");
        let past = check(slice("w.1", "w", &[6], 5), &[5.0, 6.0]);
        assert!(past.contains("part p1: the slice of w at elements [5, 5+2) is past its 6 elements"), "{past}");
        let missing = check(slice("w.9", "w", &[6], 3), &[5.0, 6.0, 7.0]);
        assert!(missing.contains("part p1 holds no tensor w.9 (its slice of w)"), "{missing}");
        let shape = check(slice("w.1", "w", &[2, 3], 3), &[5.0, 6.0, 7.0]);
        assert!(shape.contains("the slice of w is F32 of shape [2, 3], another is F32 of shape [6]"), "{shape}");
    }
}
