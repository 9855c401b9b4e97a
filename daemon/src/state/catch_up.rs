//! One step's outputs as a catch-up carries them (docs/fault-tolerance.md, "A return that does
//! not pause the survivors"): the position before the step, each parameter's averaged gradient
//! (none where the parameter has none), and the buffers after the step. A returner that holds
//! the state before the step puts the gradients in place, runs the same update, and takes the
//! buffers: the state after the step, bit for bit. With the gradient clipped (`--clip-norm`,
//! `--clip-value`), the global norm the update clips at comes first: the returner clips each
//! range of the gradient as it comes and updates it, where it would otherwise wait for the whole
//! gradient (the clip's factor is over all of it). A sharded step's
//! outputs carry the parameters after the step instead (no member holds its averaged gradient
//! whole, and the returner holds no range of the optimizer state to update with it). A bucket's
//! averaged gradients may come before the step's outputs, as the donor's reduction ends that
//! bucket during its backward pass ([`capture_bucket`]; docs/fault-tolerance.md, "By bucket"):
//! the step's outputs then leave those gradients out.

use std::collections::HashMap;
use std::ops::Range;

use trainerd_storage::tensors::Placed;
use trainerd_storage::TensorData;

use super::host as checkpoint;
use super::position::Position;
use super::replica::{Encoding, ModelState};
use super::StateError;

/// The magic of a step's outputs that carry its averaged gradients.
const MAGIC: &[u8; 8] = b"TRDSTEP1";
/// The magic of a step's outputs that carry its averaged gradients and, first, the global norm
/// its update clips them at.
const CLIPPED_MAGIC: &[u8; 8] = b"TRDSTPC1";
/// The magic of a step's outputs that carry the parameters after it.
const PARAMS_MAGIC: &[u8; 8] = b"TRDSTPP1";
/// The magic of one bucket's averaged gradients, sent before the rest of their step's outputs.
const BUCKET_MAGIC: &[u8; 8] = b"TRDBCKT1";

/// What a step's outputs carry of the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Carried {
    /// Each parameter's averaged gradient, before the update: the returner runs the update.
    Gradients,
    /// Each parameter's averaged gradient, before the update, and first the global norm the
    /// update clips it at (`--clip-norm`, `--clip-value`; the tensor [`CLIP_NORM`]): the returner
    /// clips each range as it comes and runs the update on it.
    Clipped,
    /// The parameters after the step (a sharded step's, as its all-gather left them).
    Parameters,
    /// Some of the step's averaged gradients, before the update: one bucket's, sent as the
    /// donor's reduction ended it during the backward pass; the step's own outputs follow, without
    /// them.
    Bucket,
}

/// The name of the global norm's tensor in [`Carried::Clipped`] outputs (one float64).
const CLIP_NORM: &str = "clip/norm";

impl Carried {
    /// Whether the outputs carry gradients (clipped or not).
    pub(crate) fn gradients(self) -> bool {
        self != Carried::Parameters
    }

    fn magic(self) -> &'static [u8; 8] {
        match self {
            Carried::Gradients => MAGIC,
            Carried::Clipped => CLIPPED_MAGIC,
            Carried::Parameters => PARAMS_MAGIC,
            Carried::Bucket => BUCKET_MAGIC,
        }
    }
}

/// What [`Incoming`] kept of a step's outputs, taken at their end.
struct StepOutputs {
    /// What `tensors` are.
    carried: Carried,
    /// The gradients or the parameters after the step, by parameter name.
    tensors: Vec<TensorData>,
    /// The buffers after the step, by name.
    buffers: Vec<TensorData>,
}

/// The outputs of the step `model` has just reduced (its buffers made the same on every member,
/// its position still the one before the step), as bytes: the averaged gradients (copied now,
/// before the update changes them: unscaling, clipping), but those of the parameters `sent`
/// before in a bucket ([`capture_bucket`]), with `clip_norm`, the global norm the update clips
/// them at, sent first ([`Carried::Clipped`]); or (`sharded`) the parameters after the step.
pub(crate) fn capture(
    model: &ModelState,
    sharded: bool,
    clip_norm: Option<f64>,
    sent: &[bool],
) -> Result<Vec<u8>, StateError> {
    let carried = match (sharded, clip_norm) {
        (true, _) => Carried::Parameters,
        (false, Some(_)) => Carried::Clipped,
        (false, None) => Carried::Gradients,
    };
    let norm = clip_norm.map(|n| (CLIP_NORM.to_string(), tch::Tensor::from_slice(&[n])));
    let tensors: Vec<(String, tch::Tensor)> = match carried {
        Carried::Gradients | Carried::Clipped | Carried::Bucket => norm
            .into_iter()
            .chain(model.params.iter().enumerate().filter_map(|(i, (n, p))| {
                let g = p.grad();
                (g.defined() && !sent.get(i).copied().unwrap_or(false)).then(|| (format!("grad/{n}"), g))
            }))
            .collect(),
        Carried::Parameters => model.params.iter().map(|(n, p)| (format!("param/{n}"), p.detach())).collect(),
    };
    let buffers = model.buffers.iter().map(|(n, b)| (format!("buffer/{n}"), b.shallow_clone()));
    Encoding::new(carried.magic(), &model.position, tensors.into_iter().chain(buffers).collect())?.bytes()
}

/// One bucket's averaged gradients in the step that follows `position`, as bytes
/// ([`Carried::Bucket`]), from `sums` (each parameter's name and its gradient's float32 sum over
/// the run's slots) times `scale` (1/V): each value multiplied as it is copied, the float32 product
/// the update's gradient holds.
pub(crate) fn capture_bucket(
    position: &Position,
    sums: Vec<(String, tch::Tensor)>,
    scale: f32,
) -> Result<Vec<u8>, StateError> {
    if let Some((name, t)) = sums.iter().find(|(_, t)| t.kind() != tch::Kind::Float) {
        return Err(StateError::Kind { name: name.clone(), kind: t.kind() });
    }
    let tensors = sums.into_iter().map(|(n, g)| (format!("grad/{n}"), g)).collect();
    let encoding = Encoding::new(BUCKET_MAGIC, position, tensors)?;
    let (mut out, mut head, mut scaled) = (Vec::new(), true, Vec::<f32>::new());
    encoding.write(&mut |piece| {
        if std::mem::take(&mut head) {
            return out.extend_from_slice(piece);
        }
        // Every tensor is float32 and comes in whole values, a piece at a time.
        scaled.clear();
        scaled.extend(piece.chunks_exact(4).map(|v| f32::from_le_bytes(v.try_into().expect("4 bytes")) * scale));
        out.extend_from_slice(bytemuck::cast_slice(&scaled));
    })?;
    Ok(out)
}

impl StepOutputs {
    /// Takes the parameters after the step ([`Carried::Parameters`]), checked against the model
    /// (names, types, shapes).
    pub(crate) fn set_params(&self, model: &mut ModelState) -> Result<(), StateError> {
        if self.carried != Carried::Parameters {
            return Err(StateError::Invalid("a step's outputs carry its gradients, not the parameters after it"));
        }
        checkpoint::copy_into(&mut model.params, &self.tensors, "a step's outputs")
    }

    /// Puts each gradient it holds in its parameter's `.grad` (made where the parameter has none
    /// yet): those [`Incoming`] kept, the others being in place already.
    fn kept_grads(&self, model: &mut ModelState) -> Result<(), StateError> {
        let _no_grad = tch::no_grad_guard();
        for g in &self.tensors {
            let Some((_, p)) = model.params.iter().find(|(n, _)| n == &g.name) else {
                return Err(StateError::Missing { what: "the model".into(), name: g.name.clone() });
            };
            crate::sys::autograd::ensure_grad(p);
            checkpoint::copy_bytes(&mut p.grad(), g)?;
        }
        Ok(())
    }

    /// Takes the buffers after the step.
    pub(crate) fn set_buffers(&self, model: &mut ModelState) -> Result<(), StateError> {
        let _no_grad = tch::no_grad_guard();
        checkpoint::copy_into(&mut model.buffers, &self.buffers, "a step's outputs")
    }
}

/// A step's outputs taken in as their pieces arrive, never held whole: each float32 gradient of
/// a float32 CPU parameter is written straight into its `.grad` (one copy, from the piece), and
/// [`Incoming::take`] says which of its elements are complete, so that the update of those can
/// run while the rest comes (docs/fault-tolerance.md, "By piece"). The rest (the buffers, a
/// sharded step's parameters, a gradient of another kind) is kept and taken at the end
/// ([`Incoming::finish`]).
pub(crate) struct Incoming {
    /// Bytes in all, and bytes taken so far.
    total: usize,
    got: usize,
    /// The bytes before the tensors' data, until they are all here.
    head: Vec<u8>,
    read: Option<Read>,
    /// The global norm the update clips at, once it came ([`Carried::Clipped`]).
    clip_norm: Option<f64>,
    /// Per parameter, whether its gradient in this step came in a bucket before these outputs.
    earlier: Vec<bool>,
}

/// What the head said, checked against the model.
struct Read {
    carried: Carried,
    /// Each tensor, in data order, and where its bytes go.
    tensors: Vec<(Placed, Dest)>,
    /// Per parameter, whether these outputs hold its gradient.
    sent: Vec<bool>,
    /// The first tensor whose bytes are not all here.
    cursor: usize,
}

/// Where a tensor's bytes go.
enum Dest {
    /// Straight into the gradient of parameter `usize`.
    Grad(usize),
    /// Kept, taken at the end.
    Kept(Vec<u8>),
}

impl Incoming {
    /// Outputs of `total` bytes about to arrive.
    pub(crate) fn new(total: usize) -> Incoming {
        Incoming { total, got: 0, head: Vec::new(), read: None, clip_norm: None, earlier: Vec::new() }
    }

    /// The same, in a step whose gradients of the parameters `earlier` came before in buckets
    /// ([`Carried::Bucket`]): these outputs may not hold them again.
    pub(crate) fn after(mut self, earlier: &[bool]) -> Incoming {
        self.earlier = earlier.to_vec();
        self
    }

    /// Once the head is read: per parameter, whether these outputs hold its gradient.
    pub(crate) fn carries(&self) -> Option<&[bool]> {
        self.read.as_ref().map(|r| r.sent.as_slice())
    }

    /// Whether every byte came.
    pub(crate) fn whole(&self) -> bool {
        self.got == self.total
    }

    /// Bytes taken so far.
    pub(crate) fn got(&self) -> usize {
        self.got
    }

    /// The global norm the update clips at, once it came ([`Carried::Clipped`] outputs).
    pub(crate) fn clip_norm(&self) -> Option<f64> {
        self.clip_norm
    }

    /// Once the head is read: what the outputs carry, and per parameter of `model`, whether they
    /// carry its gradient, every one of them written in place (what a ranged update needs).
    pub(crate) fn grads_in_place(&self, model: &ModelState) -> Option<(Carried, Option<Vec<bool>>)> {
        let read = self.read.as_ref()?;
        let mut with = vec![false; model.params.len()];
        for (placed, into) in &read.tensors {
            match into {
                Dest::Grad(i) => with[*i] = true,
                Dest::Kept(_) if placed.name.starts_with("grad/") => return Some((read.carried, None)),
                Dest::Kept(_) => {}
            }
        }
        Some((read.carried, read.carried.gradients().then_some(with)))
    }

    /// The next piece, taken into `model` (at the step before the outputs: checked once the head
    /// is read, before anything is written); each parameter whose gradient's elements became
    /// complete, and which.
    pub(crate) fn take(&mut self, model: &mut ModelState, piece: &[u8]) -> Result<Vec<(usize, Range<usize>)>, String> {
        if piece.len() > self.total - self.got {
            return Err(format!("a step's outputs longer than the {} bytes announced", self.total));
        }
        if self.read.is_some() {
            return Ok(self.place(model, piece));
        }
        self.head.extend_from_slice(piece);
        self.got += piece.len();
        let Some(read) = read_head(&self.head, (self.total, &self.earlier), model)? else { return Ok(Vec::new()) };
        let data = read.tensors.first().map_or(self.total, |(p, _)| p.bytes.start);
        let rest = std::mem::take(&mut self.head).split_off(data.min(self.got));
        self.got -= rest.len();
        self.read = Some(read);
        Ok(self.place(model, &rest))
    }

    /// Bytes of the data, from `self.got` on, put in place.
    fn place(&mut self, model: &ModelState, mut bytes: &[u8]) -> Vec<(usize, Range<usize>)> {
        let read = self.read.as_mut().expect("the head is read");
        let mut complete = Vec::new();
        while !bytes.is_empty() {
            let (placed, into) = &mut read.tensors[read.cursor];
            let (start, end) = (placed.bytes.start, placed.bytes.end);
            let n = bytes.len().min(end - self.got);
            let (these, rest) = bytes.split_at(n);
            match into {
                Dest::Grad(i) => {
                    let grad = model.params[*i].1.grad();
                    // SAFETY: a contiguous float32 CPU gradient of `end - start` bytes (checked
                    // when the head was read, and made then), written from byte `got - start`
                    // for `n` bytes within it, from a piece of another allocation.
                    unsafe {
                        let at = grad.data_ptr().cast::<u8>().add(self.got - start);
                        std::ptr::copy_nonoverlapping(these.as_ptr(), at, n);
                    }
                    let (from, to) = ((self.got - start) / 4, (self.got + n - start) / 4);
                    if to > from {
                        complete.push((*i, from..to));
                    }
                }
                Dest::Kept(kept) => kept.extend_from_slice(these),
            }
            self.got += n;
            bytes = rest;
            if self.got == end {
                read.cursor += 1;
                if let (Dest::Kept(norm), true) = (into, placed.name == CLIP_NORM) {
                    self.clip_norm = norm.as_slice().try_into().ok().map(f64::from_le_bytes);
                }
            }
        }
        complete
    }

    /// Once every byte came: the kept tensors taken into `model` (the buffers after the step,
    /// and a sharded step's parameters); what the outputs carried.
    pub(crate) fn finish(self, model: &mut ModelState) -> Result<Carried, String> {
        let Some(read) = self.read.filter(|_| self.got == self.total) else {
            return Err(format!("a step's outputs cut short ({} of {} bytes)", self.got, self.total));
        };
        let (mut tensors, mut buffers) = (Vec::new(), Vec::new());
        for (placed, into) in read.tensors {
            let Dest::Kept(data) = into else { continue };
            if placed.name == CLIP_NORM {
                continue; // taken as it came
            }
            let (kind, name) = placed.name.split_once('/').expect("checked when the head was read");
            let t = TensorData { name: name.to_string(), dtype: placed.dtype, shape: placed.shape, data: data.into() };
            if kind == "buffer" {
                buffers.push(t)
            } else {
                tensors.push(t)
            }
        }
        let outputs = StepOutputs { carried: read.carried, tensors, buffers };
        let taken = match outputs.carried {
            Carried::Gradients | Carried::Clipped | Carried::Bucket => outputs.kept_grads(model),
            Carried::Parameters => outputs.set_params(model),
        };
        // A bucket carries gradients alone: the buffers come with the step's outputs.
        let buffers = outputs.carried != Carried::Bucket;
        taken.and_then(|()| if buffers { outputs.set_buffers(model) } else { Ok(()) }).map_err(|e| e.to_string())?;
        Ok(outputs.carried)
    }
}

/// The head of a step's outputs of `total` bytes, once `head` holds it, checked against `model`
/// (at the step before them) and the gradients of the step that came `earlier` in buckets: where
/// each tensor goes, every gradient of a parameter written in place made there.
fn read_head(head: &[u8], (total, earlier): (usize, &[bool]), model: &ModelState) -> Result<Option<Read>, String> {
    let magic = match head.get(..8) {
        None => return Ok(None),
        Some(m) if m == MAGIC => Carried::Gradients,
        Some(m) if m == CLIPPED_MAGIC => Carried::Clipped,
        Some(m) if m == PARAMS_MAGIC => Carried::Parameters,
        Some(m) if m == BUCKET_MAGIC => Carried::Bucket,
        Some(_) => return Err("a step's outputs with no header".into()),
    };
    let Some(len) = head.get(8..16).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize) else {
        return Ok(None);
    };
    let Some(json) = head.get(16..16 + len) else { return Ok(None) };
    let before: Position = serde_json::from_slice(json).map_err(|e| format!("a step's outputs: {e}"))?;
    let at = model.position.global_step;
    if before != model.position {
        return Err(format!(
            "the outputs of step {} follow another position than the replay's (step {at})",
            before.global_step + 1
        ));
    }
    let layout = trainerd_storage::tensors::layout(&head[16 + len..], total - 16 - len);
    let Some(placed) = layout.map_err(|e| format!("a step's outputs: {e}"))? else { return Ok(None) };
    let prefix = if magic.gradients() { "grad/" } else { "param/" };
    let index: HashMap<&str, usize> = model.params.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
    let mut sent = vec![false; model.params.len()];
    let mut tensors = Vec::with_capacity(placed.len());
    for mut p in placed {
        p.bytes = p.bytes.start + 16 + len..p.bytes.end + 16 + len;
        let into = match p.name.strip_prefix(prefix).filter(|_| magic.gradients()) {
            Some(name) => {
                let Some(&i) = index.get(name) else {
                    return Err(format!("a step's outputs hold a gradient of {name}, which the model does not have"));
                };
                if sent[i] || earlier.get(i).copied().unwrap_or(false) {
                    return Err(format!("a step's outputs hold {name}'s gradient a second time"));
                }
                sent[i] = true;
                grad_in_place(model, i, &p)?
            }
            None if magic == Carried::Bucket => {
                return Err(format!("a bucket of a step's gradients holds {}, which is no gradient", p.name))
            }
            None if p.name.starts_with(prefix) || p.name.starts_with("buffer/") => None,
            None if magic == Carried::Clipped && p.name == CLIP_NORM => {
                if p.dtype != trainerd_storage::Dtype::F64 || p.bytes.len() != 8 {
                    return Err(format!("a step's outputs hold {CLIP_NORM} of {:?}, not one float64", p.dtype));
                }
                None
            }
            None => return Err(format!("a step's outputs hold {}, neither a {prefix} nor a buffer/", p.name)),
        };
        tensors.push((p, into.map_or(Dest::Kept(Vec::new()), Dest::Grad)));
    }
    if magic.gradients() && magic != Carried::Bucket {
        every_gradient_came(model, &sent, earlier)?;
    }
    Ok(Some(Read { carried: magic, tensors, sent, cursor: 0 }))
}

/// Whether a step's outputs, with its buckets that came `earlier`, `sent` the gradient of every
/// parameter of `model` that has one (a returner whose parameter has a gradient gets one each
/// step): the first that did not, by name.
fn every_gradient_came(model: &ModelState, sent: &[bool], earlier: &[bool]) -> Result<(), String> {
    let came = |i: usize| sent[i] || earlier.get(i).copied().unwrap_or(false);
    match model.params.iter().enumerate().find(|(i, (_, p))| !came(*i) && p.grad().defined()) {
        Some((_, (name, _))) => Err(format!("a step's outputs hold no gradient of {name}, which has one here")),
        None => Ok(()),
    }
}

/// Where the gradient of parameter `i` placed at `p` goes: straight into the parameter's own
/// `.grad` (`i`; made here if it has none) when both are plain float32 on the CPU, else kept
/// (`None`).
fn grad_in_place(model: &ModelState, i: usize, p: &Placed) -> Result<Option<usize>, String> {
    let (name, param) = &model.params[i];
    let shape: Vec<i64> = p.shape.iter().map(|&d| d as i64).collect();
    if shape != param.size() {
        return Err(format!("a step's outputs: {name}'s gradient has shape {shape:?}, the model's {:?}", param.size()));
    }
    let plain = crate::optim::elementwise::plain;
    if p.dtype != trainerd_storage::Dtype::F32 || !plain(param) || p.bytes.is_empty() {
        return Ok(None);
    }
    crate::sys::autograd::ensure_grad(param);
    Ok(plain(&param.grad()).then_some(i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::clip::Clip;
    use crate::optim::optimizer::Optimizer;
    use crate::state::{Optim, Shareable, TrainState};
    use tch::{Device, Kind, Tensor};
    use trainerd_sdk::OptimizerConfig;

    /// A state of two parameters (one used, one that never gets a gradient) and a buffer, with Adam.
    fn state(seed: i64) -> TrainState {
        state_with(seed, OptimizerConfig::adam(1e-2))
    }

    /// The same with the optimizer `config`.
    fn state_with(seed: i64, config: OptimizerConfig) -> TrainState {
        tch::manual_seed(seed);
        let params = vec![
            ("a".to_string(), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
            ("unused".to_string(), Tensor::randn([2], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
        ];
        let buffers = vec![("count".to_string(), Tensor::from_slice(&[seed]))];
        let optimizer = Optimizer::new(config, &params);
        TrainState::new(ModelState::new((params, buffers), 1, Device::Cpu, true), optimizer)
    }

    /// A step on `s`: a gradient for `a`, the buffer moved on, the update; its outputs.
    fn step(s: &mut TrainState, k: i64) -> Vec<u8> {
        clipped_step(s, k, &Clip::default())
    }

    /// The same with the gradient clipped by `clip` in the update, as the driver does with a
    /// returner fed: the global norm found first and sent with the gradient, which is clipped at
    /// it after ([`Carried::Clipped`]).
    fn clipped_step(s: &mut TrainState, k: i64, clip: &Clip) -> Vec<u8> {
        let a = &s.model.params[0].1;
        tch::with_grad(|| (a * a * (k as f64)).sum(Kind::Float).backward());
        let _ = s.model.buffers[0].1.fill_(10 + k);
        let norm = clip.norm_over(&s.model.params, &per_parameter(&s.model.params)).unwrap();
        let bytes = capture(&s.model, false, norm, &[]).unwrap();
        if let Some(norm) = norm {
            clip.apply_at(&s.model.params, norm).unwrap();
        }
        let Optim::Whole(o) = &mut s.optimizer else { unreachable!("whole") };
        o.step(&mut s.model.params, 0.1);
        s.model.params[0].1.zero_grad();
        s.model.position.global_step += 1;
        bytes
    }

    /// Each parameter a range of its own, as [`Clip::apply`] takes the norm.
    fn per_parameter(params: &[(String, Tensor)]) -> Vec<Vec<crate::optim::sharded_state::Piece>> {
        let piece = |(i, (_, p)): (usize, &(String, Tensor))| {
            vec![crate::optim::sharded_state::Piece { param: i, offset: 0, at: 0, len: p.numel() }]
        };
        params.iter().enumerate().map(piece).collect()
    }

    /// `bytes` (a step's outputs) taken into `s` in pieces of `piece` bytes and the update made
    /// (the gradient clipped by `clip`): range by range as the gradient arrives (`by_range`; each
    /// range clipped first at the norm that came with it), else once it is whole.
    fn take_in(s: &mut TrainState, bytes: &[u8], piece: usize, (by_range, clip): (bool, &Clip)) -> Result<(), String> {
        let mut incoming = Incoming::new(bytes.len());
        let mut rules = None;
        for chunk in bytes.chunks(piece) {
            let complete = incoming.take(&mut s.model, chunk)?;
            let Optim::Whole(o) = &mut s.optimizer else { unreachable!("whole") };
            if rules.is_none() && by_range {
                if let Some((_, Some(with))) = incoming.grads_in_place(&s.model) {
                    rules = Some(o.ranged(&s.model.params, &with, 0.1).expect("plain float32 on the CPU"));
                }
            }
            for (i, range) in complete.into_iter().filter(|_| rules.is_some()) {
                let p = &s.model.params[i].1;
                if let Some(norm) = incoming.clip_norm() {
                    clip.clip_elements(&p.grad(), Some(range.clone()), norm).unwrap();
                }
                o.update_range(i, rules.as_ref().unwrap()[i].unwrap(), (p, &p.grad()), range);
            }
        }
        assert!(incoming.whole());
        assert_eq!(rules.is_some(), by_range, "by range, where asked");
        let carried = incoming.finish(&mut s.model)?;
        if let (true, None, Optim::Whole(o)) = (carried.gradients(), &rules, &mut s.optimizer) {
            clip.apply(&s.model.params).unwrap();
            o.step(&mut s.model.params, 0.1);
        }
        s.model.position.global_step += 1;
        Ok(())
    }

    /// Every optimizer's update by range as the pieces come, whatever their size (a byte at a
    /// time cuts every float, the head too), gives the bits of the update over the whole gradient,
    /// the gradient clipped by norm or by value on the donor included.
    #[test]
    fn a_steps_outputs_taken_piece_by_piece_and_updated_by_range_give_the_same_bits() {
        let mut momentum = OptimizerConfig::sgd(0.1);
        if let OptimizerConfig::Sgd { momentum: m, weight_decay, .. } = &mut momentum {
            (*m, *weight_decay) = (0.9, 0.01);
        }
        let configs =
            [OptimizerConfig::adam(1e-2), OptimizerConfig::adamw(1e-2), momentum, OptimizerConfig::rmsprop(1e-2)];
        let clips = [Clip::default(), Clip { norm: Some(0.05), value: None }, Clip { norm: None, value: Some(0.01) }];
        for (config, clip) in configs.iter().flat_map(|c| clips.iter().map(move |clip| (c, clip))) {
            let mut donor = state_with(1, config.clone());
            let snapshot = donor.encode().unwrap();
            let outputs: Vec<Vec<u8>> = (1..=3).map(|k| clipped_step(&mut donor, k, clip)).collect();
            if !clip.is_off() {
                let mut unclipped = state_with(1, config.clone());
                (1..=3).for_each(|k| _ = step(&mut unclipped, k));
                assert_ne!(unclipped.digest().unwrap(), donor.digest().unwrap(), "{clip:?} clips these gradients");
            }
            for (piece, by_range) in [(1, true), (7, true), (50, true), (1 << 20, true), (13, false)] {
                let mut returner = state_with(2, config.clone());
                returner.decode(snapshot.clone().into()).unwrap();
                for bytes in &outputs {
                    take_in(&mut returner, bytes, piece, (by_range, clip)).unwrap();
                    assert!(!returner.model.params[1].1.grad().defined(), "a parameter without a gradient gets none");
                }
                let what = format!("{config:?}, {clip:?}, in pieces of {piece} bytes, by range: {by_range}");
                assert_eq!(returner.digest().unwrap(), donor.digest().unwrap(), "{what}");
            }
        }
    }

    /// Three parameters, `a` and `b` used, `unused` never, with the optimizer `config`.
    fn three_params(seed: i64, config: OptimizerConfig) -> TrainState {
        let mut s = state_with(seed, config.clone());
        tch::manual_seed(seed + 100);
        s.model.params.push(("b".to_string(), Tensor::randn([5], (Kind::Float, Device::Cpu)).set_requires_grad(true)));
        s.optimizer = Optim::Whole(Optimizer::new(config, &s.model.params));
        s
    }

    /// A step on `s` whose gradient of `b` is sent in a bucket before the rest of its outputs,
    /// as the donor's reducing thread sends it: (the bucket, the outputs).
    fn bucketed_step(s: &mut TrainState, k: i64) -> (Vec<u8>, Vec<u8>) {
        let (a, b) = (&s.model.params[0].1, &s.model.params[2].1);
        tch::with_grad(|| ((a * a * (k as f64)).sum(Kind::Float) + (b * b * b).sum(Kind::Float)).backward());
        let _ = s.model.buffers[0].1.fill_(10 + k);
        // The bucket's sum over 2 slots, as the reduction leaves it, and its average.
        let sum = s.model.params[2].1.grad() * 2.0;
        let bucket = capture_bucket(&s.model.position, vec![("b".into(), sum)], 0.5).unwrap();
        let outputs = capture(&s.model, false, None, &[false, false, true]).unwrap();
        let Optim::Whole(o) = &mut s.optimizer else { unreachable!("whole") };
        o.step(&mut s.model.params, 0.1);
        s.model.params.iter().for_each(|(_, p)| _ = p.grad().defined().then(|| p.grad().zero_()));
        s.model.position.global_step += 1;
        (bucket, outputs)
    }

    /// `bytes` taken into `s` in pieces of `piece` bytes (after the gradients of the step that
    /// came `earlier`), each complete range updated by `rules` as it comes, the rules of the
    /// gradients these bytes carry made first (`ranged`: the step's first item, which counts the
    /// step; else joined to it); what they carried.
    fn take_ranged(
        s: &mut TrainState,
        (bytes, piece, earlier): (&[u8], usize, &[bool]),
        rules: &mut Option<crate::optim::optimizer::RangedRules>,
    ) -> Result<Vec<bool>, String> {
        let mut incoming = Incoming::new(bytes.len()).after(earlier);
        let mut joined = false;
        for chunk in bytes.chunks(piece) {
            let complete = incoming.take(&mut s.model, chunk)?;
            let Optim::Whole(o) = &mut s.optimizer else { unreachable!("whole") };
            if let (false, Some((_, Some(with)))) = (joined, incoming.grads_in_place(&s.model)) {
                joined = true;
                match rules.as_mut() {
                    None => *rules = Some(o.ranged(&s.model.params, &with, 0.1).expect("plain")),
                    Some(r) => {
                        let more = o.more_ranged(&s.model.params, &with, 0.1);
                        r.iter_mut().zip(more).filter(|(_, m)| m.is_some()).for_each(|(r, m)| *r = m);
                    }
                }
            }
            for (i, range) in complete {
                let p = &s.model.params[i].1;
                o.update_range(i, rules.as_ref().unwrap()[i].unwrap(), (p, &p.grad()), range);
            }
        }
        let carried = incoming.carries().expect("the head came").to_vec();
        incoming.finish(&mut s.model)?;
        Ok(carried)
    }

    /// A step's gradients sent partly in a bucket before its outputs (docs/fault-tolerance.md,
    /// "By bucket"): the returner updates the bucket's parameters range by range as they come,
    /// then the outputs' (which leave the bucket's out), with the step counted once: the donor's
    /// bits, for every optimizer and piece size. Outputs that repeat a gradient the bucket
    /// carried, or taken as if no bucket had come, are refused before anything is written.
    #[test]
    fn a_steps_gradients_in_a_bucket_before_its_outputs_give_the_same_bits() {
        let mut momentum = OptimizerConfig::sgd(0.1);
        if let OptimizerConfig::Sgd { momentum: m, .. } = &mut momentum {
            *m = 0.9;
        }
        for config in [OptimizerConfig::adam(1e-2), momentum, OptimizerConfig::rmsprop(1e-2)] {
            for piece in [1, 9, 1 << 20] {
                let mut donor = three_params(1, config.clone());
                let mut returner = three_params(2, config.clone());
                returner.decode(donor.encode().unwrap().into()).unwrap();
                for k in 1..=3 {
                    let (bucket, outputs) = bucketed_step(&mut donor, k);
                    let mut rules = None;
                    let earlier = take_ranged(&mut returner, (&bucket, piece, &[]), &mut rules).unwrap();
                    assert_eq!(earlier, [false, false, true], "the bucket carries b's gradient");
                    if k == 1 {
                        let err = take_ranged(&mut returner, (&bucket, piece, &earlier), &mut None);
                        assert_eq!(err.unwrap_err(), "a step's outputs hold b's gradient a second time");
                        let err = Incoming::new(outputs.len()).take(&mut returner.model, &outputs).err();
                        assert_eq!(err.unwrap(), "a step's outputs hold no gradient of b, which has one here");
                        let buffer = vec![("buffer/count".to_string(), Tensor::from_slice(&[1i64]))];
                        let odd =
                            Encoding::new(BUCKET_MAGIC, &returner.model.position, buffer).unwrap().bytes().unwrap();
                        let err = Incoming::new(odd.len()).take(&mut returner.model, &odd).err();
                        assert_eq!(
                            err.unwrap(),
                            "a bucket of a step's gradients holds buffer/count, which is no gradient"
                        );
                    }
                    let carried = take_ranged(&mut returner, (&outputs, piece, &earlier), &mut rules).unwrap();
                    assert_eq!(carried, [true, false, false], "the outputs carry a's gradient alone");
                    returner.model.position.global_step += 1;
                }
                let what = format!("{config:?} in pieces of {piece} bytes");
                assert_eq!(returner.digest().unwrap(), donor.digest().unwrap(), "{what}");
                assert!(!returner.model.params[1].1.grad().defined(), "{what}: no gradient made for unused");
            }
        }
    }

    /// A sharded step's outputs: the parameters and buffers after it, taken as they are.
    #[test]
    fn a_sharded_steps_outputs_carry_the_parameters_after_it() {
        let mut donor = state(1);
        let snapshot = donor.encode().unwrap();
        let mut returner = state(2);
        returner.decode(snapshot.into()).unwrap();
        let before = donor.model.position.clone();
        step(&mut donor, 1);
        donor.model.position = before;
        let bytes = capture(&donor.model, true, None, &[]).unwrap();
        let mut incoming = Incoming::new(bytes.len());
        assert_eq!(incoming.take(&mut returner.model, &bytes).unwrap(), [], "nothing is put in place");
        assert_eq!(
            incoming.grads_in_place(&returner.model).map(|(c, w)| (c, w.is_none())),
            Some((Carried::Parameters, true))
        );
        assert_eq!(incoming.finish(&mut returner.model).unwrap(), Carried::Parameters);
        assert_eq!(returner.model.params_sha256(), donor.model.params_sha256());
        assert!(!returner.model.params[0].1.grad().defined(), "no gradient is made");
    }

    #[test]
    fn outputs_that_do_not_follow_the_replay_are_refused_before_anything_is_written() {
        let mut donor = state(1);
        let stale = capture(&donor.model, false, None, &[]).unwrap();
        step(&mut donor, 1);
        let a = donor.model.params[0].1.copy();
        let mut incoming = Incoming::new(stale.len());
        let err = incoming.take(&mut donor.model, &stale).err().unwrap();
        assert_eq!(err, "the outputs of step 1 follow another position than the replay's (step 1)");
        // The donor's gradient of `a` is still there: outputs without it are refused by name.
        let mut s = state(1);
        tch::with_grad(|| (&s.model.params[0].1 * 2.0).sum(Kind::Float).backward());
        let none = capture(&state(1).model, false, None, &[]).unwrap();
        let err = Incoming::new(none.len()).take(&mut s.model, &none).err().unwrap();
        assert_eq!(err, "a step's outputs hold no gradient of a, which has one here");
        assert_eq!(donor.model.params[0].1, a, "nothing was written");
        let state_bytes = donor.encode().unwrap();
        let err = Incoming::new(state_bytes.len()).take(&mut donor.model, &state_bytes).err().unwrap();
        assert_eq!(err, "a step's outputs with no header");
        let (mut short, mut s) = (Incoming::new(stale.len()), state(1));
        short.take(&mut s.model, &stale[..stale.len() - 5]).unwrap();
        let err = short.finish(&mut s.model).err().unwrap();
        assert_eq!(err, format!("a step's outputs cut short ({} of {} bytes)", stale.len() - 5, stale.len()));
    }
}
