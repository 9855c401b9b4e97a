//! Tensors between libtorch and host memory: a checkpoint's and a state transfer's
//! [`TensorData`] from a tensor, a tensor from it, and restored values copied into a model's
//! tensors with their names, types and shapes checked. Every dtype a checkpoint holds keeps its
//! bits.

use bytes::Bytes;
use tch::{Device, Kind, Tensor};
use trainerd_storage::{Dtype, TensorData};

use super::StateError;

pub(crate) fn dtype(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        _ => return None,
    })
}

fn kind(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
    }
}

/// A tensor's elements as contiguous native-endian bytes in host memory.
pub(crate) fn host_bytes(t: &Tensor) -> Result<Vec<u8>, tch::TchError> {
    let t = t.detach().to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut data, numel)?;
    Ok(data)
}

/// Elements per piece when a tensor's bytes are streamed ([`stream_bytes`]): the most copied to
/// host memory at once.
const PIECE: i64 = 1 << 22;
#[cfg(test)]
pub(crate) const PIECE_FOR_TESTS: i64 = PIECE;

/// A tensor's elements as [`host_bytes`] gives them, handed to `sink` a piece at a time, so that
/// hashing or assembling a state never holds a second copy of a whole tensor.
pub(crate) fn stream_bytes(name: &str, t: &Tensor, sink: &mut dyn FnMut(&[u8])) -> Result<(), StateError> {
    let failed = |source| StateError::Tensor { name: name.into(), source };
    let flat = t.detach().f_reshape([-1]).map_err(failed)?;
    let (numel, size) = (flat.numel() as i64, t.kind().elt_size_in_bytes());
    let mut piece = Vec::new();
    let mut at = 0;
    while at < numel {
        let n = PIECE.min(numel - at);
        let values = flat.f_narrow(0, at, n).map_err(failed)?.to_device(Device::Cpu).contiguous();
        piece.resize(n as usize * size, 0);
        values.f_copy_data_u8(&mut piece, n as usize).map_err(failed)?;
        sink(&piece);
        at += n;
    }
    Ok(())
}

/// Copies a tensor into host memory.
pub(crate) fn host_copy(name: &str, t: &Tensor) -> Result<TensorData, StateError> {
    let dtype = dtype(t.kind()).ok_or_else(|| StateError::Kind { name: name.into(), kind: t.kind() })?;
    let data = host_bytes(t).map_err(|source| StateError::Tensor { name: name.into(), source })?;
    Ok(TensorData {
        name: name.into(),
        dtype,
        shape: t.size().iter().map(|&d| d as usize).collect(),
        data: Bytes::from(data),
    })
}

/// A tensor (on the CPU) from host memory.
pub(crate) fn to_tensor(t: &TensorData) -> Result<Tensor, StateError> {
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&t.data, &shape, kind(t.dtype))
        .map_err(|source| StateError::Tensor { name: t.name.clone(), source })
}

/// Copies restored values into `dst` (name, tensor) in place, checking names, types and
/// shapes. `what` names the source in messages ("checkpoint 3's model").
pub(crate) fn copy_into(dst: &mut [(String, Tensor)], src: &[TensorData], what: &str) -> Result<(), StateError> {
    let _no_grad = tch::no_grad_guard();
    for (name, t) in dst.iter_mut() {
        let Some(s) = src.iter().find(|s| &s.name == name) else {
            return Err(StateError::Missing { what: what.into(), name: name.clone() });
        };
        let shape: Vec<i64> = s.shape.iter().map(|&d| d as i64).collect();
        if shape != t.size() {
            let (found, expected) = (shape, t.size());
            return Err(StateError::Shape { what: what.into(), name: name.clone(), found, expected });
        }
        if kind(s.dtype) != t.kind() {
            let (found, expected) = (kind(s.dtype), t.kind());
            return Err(StateError::Type { what: what.into(), name: name.clone(), found, expected });
        }
        copy_bytes(t, s)?;
    }
    Ok(())
}

/// Copies `s`'s bytes into `t` (same shape; another type is converted): straight into its memory when it is a
/// contiguous CPU tensor of that many bytes (one copy, where going through a tensor made from the
/// bytes takes two: a state received or a step's outputs replayed is copied in on the returner's
/// way back), else through such a tensor.
pub(crate) fn copy_bytes(t: &mut Tensor, s: &TensorData) -> Result<(), StateError> {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if t.device() == Device::Cpu && t.is_contiguous() && kind(s.dtype) == t.kind() && s.data.len() == len && len > 0 {
        // SAFETY: `t` is a contiguous CPU tensor whose storage holds `len` bytes from its data
        // pointer, and `s.data` is `len` bytes of another allocation (bytes received or read).
        unsafe { std::ptr::copy_nonoverlapping(s.data.as_ptr(), t.data_ptr().cast::<u8>(), len) };
        return Ok(());
    }
    let value = to_tensor(s)?;
    t.f_copy_(&value).map_err(|source| StateError::Tensor { name: s.name.clone(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_copies_round_trip() {
        let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]);
        let d = host_copy("t", &t).unwrap();
        assert_eq!((d.dtype, d.shape.clone(), d.data.len()), (Dtype::F32, vec![3, 4], 48));
        let back = to_tensor(&d).unwrap();
        assert_eq!(back, t);
        let mut dst = vec![("t".to_string(), Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)))];
        copy_into(&mut dst, std::slice::from_ref(&d), "the checkpoint's model").unwrap();
        assert_eq!(dst[0].1, t);
        let mut wrong = vec![("t".to_string(), Tensor::zeros([4], (Kind::Float, Device::Cpu)))];
        assert_eq!(
            copy_into(&mut wrong, &[d], "the checkpoint's model").unwrap_err().to_string(),
            "the checkpoint's model tensor t has shape [3, 4], the model's has [4]"
        );
    }
}
