//! A member's parts of a sharded commit (docs/fault-tolerance.md, "Sharded commits"): the pieces
//! of the parameters and of the optimizer state in the ranges it owns, each stored as a
//! one-dimensional tensor and recorded as a slice (name, element range) of the tensor the
//! unsharded commit holds whole; a reader puts them back together
//! ([`trainerd_storage::parts::assemble`]).

use tch::Tensor;
use trainerd_storage::{Part, Slice, TensorData};

use super::sharded_step::param_values;
use crate::optim::sharded_state::ShardedOptimizer;
use crate::state::{host, MODEL_BLOB, OPTIMIZER_BLOB};

/// A part being made: its tensors and what each is a slice of.
#[derive(Default)]
struct Making {
    tensors: Vec<TensorData>,
    slices: Vec<Slice>,
}

impl Making {
    /// The elements `[offset, offset + len)` of tensor `name` (of `shape`), as their bytes.
    fn push(&mut self, (name, shape): (&str, Vec<usize>), offset: usize, t: TensorData) {
        let stored = format!("{name}@{offset}");
        self.slices.push(Slice { stored: stored.clone(), tensor: name.to_string(), shape, offset });
        let len = t.shape.iter().product();
        self.tensors.push(TensorData { name: stored, shape: vec![len], ..t });
    }

    /// The float32 `values` at `offset` in tensor `name` (of `shape`).
    fn push_f32(&mut self, (name, shape): (&str, Vec<usize>), offset: usize, values: &[f32]) {
        let t = TensorData {
            name: String::new(),
            dtype: trainerd_storage::Dtype::F32,
            shape: vec![values.len()],
            data: bytes::Bytes::copy_from_slice(bytemuck::cast_slice(values)),
        };
        self.push((name, shape), offset, t);
    }

    fn part(self, blob: &str, stem: &str, place: usize) -> Part {
        Part {
            blob: blob.into(),
            file: format!("{stem}.part-{place}.safetensors"),
            tensors: self.tensors,
            slices: self.slices,
        }
    }
}

/// This member's parts of a sharded commit (it is `place`): its owned ranges' pieces of `params`
/// and of `optimizer`'s state, and with `buffers` (the coordinator's) every buffer whole.
pub(crate) fn parts(
    params: &[(String, Tensor)],
    buffers: Option<&[(String, Tensor)]>,
    optimizer: &ShardedOptimizer,
    place: usize,
) -> Vec<Part> {
    let shape = |t: &Tensor| t.size().iter().map(|&d| d as usize).collect::<Vec<_>>();
    let mut model = Making::default();
    for piece in optimizer.owned_pieces() {
        let (name, p) = &params[piece.param];
        model.push_f32((name, shape(p)), piece.offset, &param_values(p, piece));
    }
    for (name, t) in buffers.unwrap_or_default() {
        model.push((name, shape(t)), 0, host::host_copy(name, t).expect("a buffer of a checkpoint's dtypes"));
    }
    let mut state = Making::default();
    for (slot, piece, values) in optimizer.pieces(false) {
        let (name, p) = &params[piece.param];
        state.push_f32((&format!("{name}/{slot}"), shape(p)), piece.offset, values);
    }
    vec![model.part(MODEL_BLOB, "model", place), state.part(OPTIMIZER_BLOB, "optimizer", place)]
}
