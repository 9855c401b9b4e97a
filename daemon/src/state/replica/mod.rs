//! A replica's state as one value, in two layers: the model's ([`ModelState`]: where training
//! stands, the parameters, the buffers such as BatchNorm's running statistics) and, for training,
//! the optimizer's ([`TrainState`]). An evaluation needs only the first. Either is what a member
//! receives from a live peer (`encode`, `decode`: raw bytes, every dtype exact, fingerprinted by
//! sha256), and a [`TrainState`] is what the chief commits ([`TrainState::blobs`],
//! [`TrainState::restore`]).
//!
//! A step changes it only after its all-reduce has completed on this member, so an abandoned step
//! leaves it exactly at the previous step (buffers that a forward pass updates in place are put
//! back: [`ModelState::save_buffers`]). Every tensor keeps its dtype: float64 and integer state
//! crosses encodes, transfers and checkpoints bit for bit.

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};
use trainerd_sdk::OptimizerConfig;
use trainerd_storage::{tensors, Blob, Restored, TensorData};

use super::host as checkpoint;
use super::position::Position;
use super::{StateError, MODEL_BLOB, OPTIMIZER_BLOB};
use crate::optim::optimizer::Optimizer;
use crate::optim::sharded_state::ShardedOptimizer;

const MAGIC: &[u8; 8] = b"TRDSTAT1";
/// The magic of a training state whose optimizer state is not in its bytes: sharded over the
/// generation's members, or not made yet (a sharded run before its first step). A receiver takes
/// the source's kind from it: plain SGD's whole state holds no tensors either, so the bytes alone
/// cannot tell (a restarted coordinator that restored a commit stayed whole among sharded
/// members, and sent them all back to it; with Adam, it could not take the state at all). Part
/// of the digest, as the kind is part of the state.
const SHARDED_MAGIC: &[u8; 8] = b"TRDSHRD1";
/// The magic of a training state whose optimizer state is a commit's, not read yet
/// ([`Optim::Committed`]): its bytes hold the commit's sequence and its manifest's sha256
/// (tensors [`SEQUENCE_TENSOR`] and [`MANIFEST_TENSOR`]) where a whole state holds the
/// optimizer's tensors.
const COMMITTED_MAGIC: &[u8; 8] = b"TRDCMIT1";
/// The tensor of a [`COMMITTED_MAGIC`] state's bytes that holds its commit's sequence.
const SEQUENCE_TENSOR: &str = "optimizer.commit/sequence";
/// The tensor of a [`COMMITTED_MAGIC`] state's bytes that holds its commit's manifest's sha256.
const MANIFEST_TENSOR: &str = "optimizer.commit/manifest";

/// What a member brings to a formation: how far its state is, and the state itself as bytes for
/// the members that lack it (a [`TrainState`] in training, a [`ModelState`] in an evaluation).
pub(crate) trait Shareable {
    /// How far it is: larger is further.
    fn progress(&self) -> (u64, u64);
    /// Whether it is a state of the run (a fresh process's model is not, unless it is the
    /// chief's).
    fn live(&self) -> bool;
    /// The state's encoding, to be assembled or hashed.
    fn encoding(&self) -> Result<Encoding, StateError>;

    /// The state as bytes.
    fn encode(&self) -> Result<Vec<u8>, StateError> {
        self.encoding()?.bytes()
    }

    /// The sha256 of [`Shareable::encode`], lower-case hex, computed without assembling it; empty
    /// when it holds no state of the run.
    fn digest(&self) -> Result<String, StateError> {
        if !self.live() {
            return Ok(String::new());
        }
        self.sha256()
    }

    /// The sha256 of the start state this process built from the run's seed, where it holds that
    /// and no state of the run (a fresh process that does not coordinate): a formation whose
    /// source holds the same sends it nothing. Empty otherwise.
    fn start_digest(&self) -> Result<String, StateError> {
        if self.live() || self.progress() != (0, 0) {
            return Ok(String::new());
        }
        self.sha256()
    }

    /// The sha256 of [`Shareable::encode`], whatever the state.
    fn sha256(&self) -> Result<String, StateError> {
        let mut hasher = Sha256::new();
        self.encoding()?.write(&mut |b| hasher.update(b))?;
        Ok(hex(&hasher.finalize()))
    }
}

/// A state's encoding: magic, the position's JSON (length-prefixed), then safetensors (its
/// tensors sorted by name). Written a piece at a time ([`Encoding::write`]), so that hashing a
/// state takes no copy of it, and assembled once for a transfer ([`Encoding::bytes`]).
pub(crate) struct Encoding {
    /// Everything before the tensors' data.
    head: Vec<u8>,
    /// The tensors, in the order their data follows.
    tensors: Vec<(String, Tensor)>,
    /// Bytes in all.
    len: usize,
}

impl Encoding {
    pub(super) fn new(
        magic: &[u8; 8],
        position: &Position,
        tensors: Vec<(String, Tensor)>,
    ) -> Result<Encoding, StateError> {
        let position = serde_json::to_vec(position).map_err(StateError::EncodePosition)?;
        let shapes: Vec<Vec<usize>> =
            tensors.iter().map(|(_, t)| t.size().iter().map(|&d| d as usize).collect()).collect();
        let mut entries = Vec::with_capacity(tensors.len());
        for ((name, t), shape) in tensors.iter().zip(&shapes) {
            let dtype =
                checkpoint::dtype(t.kind()).ok_or_else(|| StateError::Kind { name: name.clone(), kind: t.kind() })?;
            entries.push((name.as_str(), dtype, shape.as_slice()));
        }
        let (header, order) = trainerd_storage::tensors::header(&entries).map_err(StateError::EncodeTensors)?;
        let data: usize = tensors.iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum();
        let mut head = Vec::with_capacity(16 + position.len() + header.len());
        head.extend_from_slice(magic);
        head.extend_from_slice(&(position.len() as u64).to_le_bytes());
        head.extend_from_slice(&position);
        head.extend_from_slice(&header);
        let len = head.len() + data;
        let mut unsorted: Vec<Option<(String, Tensor)>> = tensors.into_iter().map(Some).collect();
        let tensors = order.iter().map(|&i| unsorted[i].take().expect("each index once")).collect();
        Ok(Encoding { head, tensors, len })
    }

    /// Hands the encoding's bytes to `sink`, in order, a piece at a time.
    pub(crate) fn write(&self, sink: &mut dyn FnMut(&[u8])) -> Result<(), StateError> {
        sink(&self.head);
        self.tensors.iter().try_for_each(|(name, t)| checkpoint::stream_bytes(name, t, sink))
    }

    /// The encoding's bytes, assembled.
    pub(crate) fn bytes(&self) -> Result<Vec<u8>, StateError> {
        let mut out = Vec::with_capacity(self.len);
        self.write(&mut |b| out.extend_from_slice(b))?;
        Ok(out)
    }
}

/// The sha256 of `bytes`, lower-case hex: how a state's report and its receiver fingerprint it.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// A digest as lower-case hex.
fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) use crate::plugin::Named;

/// The model's part of a replica: position, parameters and buffers.
pub(crate) struct ModelState {
    /// Where training stands.
    pub(crate) position: Position,
    /// The model's trainable parameters (shared with the plugin's model), in name order.
    pub(crate) params: Named,
    /// The model's non-trainable variables (shared with the plugin's model), in name order.
    pub(crate) buffers: Named,
    /// False for a process that has not received or restored a state yet (its freshly built
    /// model is not the run's state unless it is the chief's).
    pub(crate) live: bool,
    device: Device,
}

/// A training replica: the model's state and the optimizer's.
pub(crate) struct TrainState {
    /// Position, parameters and buffers.
    pub(crate) model: ModelState,
    /// The optimizer and its state tensors: all of them, or this member's ranges.
    pub(crate) optimizer: Optim,
    /// A sharded optimizer's whole state, gathered from every member into host memory for a
    /// commit of this position (named `<parameter>/<slot>`, in parameter order).
    pub(crate) gathered: Option<Vec<TensorData>>,
}

/// The optimizer of a training replica.
#[derive(Debug)]
pub(crate) enum Optim {
    /// Every state tensor.
    Whole(Optimizer),
    /// The state of the ranges this member owns (`--shard-optimizer`): the parameters, buffers
    /// and position are still every member's, the optimizer state is not whole anywhere.
    Sharded(ShardedOptimizer),
    /// A sharded run's optimizer before its first step: no state yet, so that no member ever
    /// holds the whole (each makes its ranges' state at the first step; as a whole optimizer's
    /// at its start, that state is zeros, or SGD's buffers not made yet).
    Fresh(OptimizerConfig),
    /// A sharded run's optimizer state as commit `sequence` holds it, not read yet (a resume, or
    /// every member gone back to the last commit): once a generation forms, each member reads
    /// its own ranges and its buddy copies of it from the checkpoint location, so that no member
    /// ever holds it whole (docs/fault-tolerance.md, "A sharded run's resume").
    Committed {
        /// The optimizer's settings.
        config: OptimizerConfig,
        /// The commit that holds the state.
        sequence: u64,
        /// Its manifest's sha256 (lower-case hex): another location's commit of that sequence
        /// (a checkpoint directory local to each node) is not this one.
        manifest: String,
    },
}

impl Optim {
    /// The optimizer, when it holds every state tensor.
    pub(crate) fn whole(&self) -> Option<&Optimizer> {
        match self {
            Optim::Whole(o) => Some(o),
            Optim::Sharded(_) | Optim::Fresh(_) | Optim::Committed { .. } => None,
        }
    }

    /// Whether the state is sharded over the generation's members (no member holds it whole).
    pub(crate) fn sharded(&self) -> bool {
        matches!(self, Optim::Sharded(_))
    }

    /// The optimizer's configuration.
    pub(crate) fn config(&self) -> &OptimizerConfig {
        match self {
            Optim::Whole(o) => o.config(),
            Optim::Sharded(s) => s.config(),
            Optim::Fresh(config) | Optim::Committed { config, .. } => config,
        }
    }

    /// Bytes of optimizer state this member holds.
    pub(crate) fn state_bytes(&self) -> u64 {
        let (own, buddy) = self.state_bytes_apart();
        own + buddy
    }

    /// Bytes of optimizer state this member holds: its own (all of it, unsharded), and its buddy
    /// copies (sharded).
    pub(crate) fn state_bytes_apart(&self) -> (u64, u64) {
        match self {
            Optim::Whole(o) => {
                (o.state().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum(), 0)
            }
            Optim::Sharded(s) => s.state_bytes_apart(),
            Optim::Fresh(_) | Optim::Committed { .. } => (0, 0),
        }
    }
}

impl ModelState {
    /// The model's variables `(params, buffers)` at the start of training.
    pub(crate) fn new((params, buffers): (Named, Named), metrics: usize, device: Device, live: bool) -> ModelState {
        ModelState { position: Position::start(metrics), params, buffers, live, device }
    }

    /// Every model variable, parameters then buffers.
    pub(crate) fn variables(&self) -> impl Iterator<Item = &(String, Tensor)> {
        self.params.iter().chain(&self.buffers)
    }

    /// sha256 over every variable's bytes, in name order (a summary's `params_sha256`).
    pub(crate) fn params_sha256(&self) -> String {
        let mut sorted: Vec<&(String, Tensor)> = self.variables().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut hasher = Sha256::new();
        for (name, p) in sorted {
            hasher.update(checkpoint::host_bytes(p).unwrap_or_else(|e| panic!("reading parameter {name}: {e}")));
        }
        format!("{:x}", hasher.finalize())
    }

    /// A copy of every buffer, to put back with [`ModelState::restore_buffers`] when a step is
    /// abandoned after its forward pass updated them. Empty when the model has none.
    pub(crate) fn save_buffers(&self) -> Vec<Tensor> {
        self.buffers.iter().map(|(_, b)| b.detach().copy()).collect()
    }

    /// Puts back buffers saved by [`ModelState::save_buffers`].
    pub(crate) fn restore_buffers(&mut self, saved: &[Tensor]) {
        let _no_grad = tch::no_grad_guard();
        for ((_, b), s) in self.buffers.iter_mut().zip(saved) {
            b.copy_(s);
        }
    }

    /// Parameters and buffers (shallow handles), each named `PREFIXNAME`.
    fn prefixed(&self, prefix: &str) -> Vec<(String, Tensor)> {
        self.variables().map(|(n, t)| (format!("{prefix}{n}"), t.shallow_clone())).collect()
    }

    /// Copies parameters and buffers in from `model`, checked against this model (names, types,
    /// shapes); `what` names the source in messages.
    fn copy_in(&mut self, model: &[TensorData], what: &str) -> Result<(), StateError> {
        checkpoint::copy_into(&mut self.params, model, what)?;
        checkpoint::copy_into(&mut self.buffers, model, what)
    }

    /// The variables copied in are the run's state at `position`.
    fn take(&mut self, position: Position) {
        self.position = position;
        self.live = true;
    }

    /// [`ModelState::copy_in`], then [`ModelState::take`].
    fn load(&mut self, position: Position, model: &[TensorData], what: &str) -> Result<(), StateError> {
        self.copy_in(model, what)?;
        self.take(position);
        Ok(())
    }

    /// Takes only the model of a verified checkpoint, and `position`: what an evaluation needs,
    /// whatever optimizer trained it.
    pub(crate) fn restore(&mut self, restored: &Restored, position: Position) -> Result<(), StateError> {
        let seq = restored.record.sequence;
        let model = restored.blobs.get(MODEL_BLOB).ok_or(StateError::NoBlob { sequence: seq, blob: MODEL_BLOB })?;
        self.load(position, model, &format!("checkpoint {seq}'s model"))
    }

    /// Takes a peer's model state from `bytes`.
    pub(crate) fn decode(&mut self, bytes: Bytes) -> Result<(), StateError> {
        let Decoded { position, model, .. } = decode(bytes)?;
        self.load(position, &model, "the received state's model")
    }
}

impl Shareable for ModelState {
    fn progress(&self) -> (u64, u64) {
        self.position.progress()
    }

    fn live(&self) -> bool {
        self.live
    }

    fn encoding(&self) -> Result<Encoding, StateError> {
        Encoding::new(MAGIC, &self.position, self.prefixed("model/"))
    }
}

impl TrainState {
    /// A state at the start of training.
    pub(crate) fn new(model: ModelState, optimizer: Optimizer) -> Self {
        TrainState { model, optimizer: Optim::Whole(optimizer), gathered: None }
    }

    /// A sharded run's state at the start of training: the optimizer has no state yet.
    pub(crate) fn fresh(model: ModelState, config: OptimizerConfig) -> Self {
        TrainState { model, optimizer: Optim::Fresh(config), gathered: None }
    }

    /// Where training stands.
    pub(crate) fn position(&self) -> &Position {
        &self.model.position
    }

    /// The magic of this state's bytes: whether its optimizer state is in them.
    fn magic(&self) -> &'static [u8; 8] {
        match self.optimizer {
            Optim::Whole(_) => MAGIC,
            Optim::Sharded(_) | Optim::Fresh(_) => SHARDED_MAGIC,
            Optim::Committed { .. } => COMMITTED_MAGIC,
        }
    }

    /// What a state's bytes hold of its optimizer besides the model: every state tensor of a
    /// whole one, a committed one's commit (its sequence and manifest digest), nothing of a
    /// sharded one (its state differs between members by design: what they share, and compare,
    /// is the rest, under the magic that says so).
    fn optimizer_tensors(&self) -> Vec<(String, Tensor)> {
        match &self.optimizer {
            Optim::Whole(optimizer) => {
                optimizer.state().into_iter().map(|(n, t)| (format!("optimizer/{n}"), t)).collect()
            }
            Optim::Committed { sequence, manifest, .. } => vec![
                (SEQUENCE_TENSOR.to_string(), Tensor::from_slice(&[*sequence as i64])),
                (MANIFEST_TENSOR.to_string(), Tensor::from_slice(manifest.as_bytes())),
            ],
            Optim::Sharded(_) | Optim::Fresh(_) => Vec::new(),
        }
    }

    /// Whether a peer's state `bytes` hold the optimizer state as this state does (whole, or not
    /// at all): a state of the other kind at the same step differs from this one by its kind.
    pub(crate) fn same_kind(&self, bytes: &[u8]) -> bool {
        bytes.get(..8) == Some(&self.magic()[..])
    }

    /// Takes a peer's state from `bytes` (checked against this model: names, types, shapes), or
    /// this member's own agreed copy, with the optimizer state's kind the bytes say.
    pub(crate) fn decode(&mut self, bytes: Bytes) -> Result<(), StateError> {
        let Decoded { position, model, optim, kind } = decode(bytes)?;
        match kind {
            Carried::Whole => self.load(position, &model, &optim, "the received state"),
            Carried::Sharded => self.load_sharded(position, &model),
            Carried::Committed(sequence, manifest) => {
                self.model.load(position, &model, "the received state's model")?;
                self.optimizer = Optim::Committed { config: self.optimizer.config().clone(), sequence, manifest };
                Ok(())
            }
        }
    }

    /// Copies parameters, buffers and the whole optimizer state in, and takes `position`; `what`
    /// names the source in messages.
    fn load(
        &mut self,
        position: Position,
        model: &[TensorData],
        optim: &[TensorData],
        what: &str,
    ) -> Result<(), StateError> {
        self.model.copy_in(model, &format!("{what}'s model"))?;
        let device = self.model.device;
        let state: Vec<(String, Tensor)> = optim
            .iter()
            .map(|t| Ok((t.name.clone(), checkpoint::to_tensor(t)?.to_device(device))))
            .collect::<Result<_, StateError>>()?;
        if !matches!(self.optimizer, Optim::Whole(_)) {
            self.optimizer = Optim::Whole(Optimizer::new(self.optimizer.config().clone(), &self.model.params));
        }
        let Optim::Whole(optimizer) = &mut self.optimizer else { unreachable!("made whole above") };
        optimizer
            .restore(position.global_step, &state)
            .map_err(|source| StateError::Optimizer { what: what.into(), source })?;
        self.model.take(position);
        Ok(())
    }

    /// Copies parameters and buffers in from a state whose optimizer state is sharded, and takes
    /// `position`. At a sharded run's start, the optimizer has no state yet; later, this member
    /// holds no range until the formation moves its own to it ([`crate::train::sharded`]). A
    /// member that holds ranges keeps them (the formation moves them, or finds them a step
    /// behind); a whole state is let go (the others' ranges are the run's).
    fn load_sharded(&mut self, position: Position, model: &[TensorData]) -> Result<(), StateError> {
        self.model.copy_in(model, "the received state's model")?;
        let config = self.optimizer.config().clone();
        self.optimizer =
            match (position.global_step, std::mem::replace(&mut self.optimizer, Optim::Fresh(config.clone()))) {
                (0, _) => Optim::Fresh(config),
                (_, Optim::Sharded(held)) => Optim::Sharded(held),
                _ => Optim::Sharded(ShardedOptimizer::new(config, &self.model.params, (&[], &[]))),
            };
        self.model.take(position);
        Ok(())
    }

    /// Takes a verified checkpoint's state (its metadata already checked against this run). An
    /// optimizer blob the commit holds and the read left out (verified as a stream: a sharded run
    /// reads it by range) leaves the optimizer [`Optim::Committed`].
    pub(crate) fn restore(&mut self, restored: &Restored, position: Position) -> Result<(), StateError> {
        let seq = restored.record.sequence;
        let blob =
            |name: &'static str| restored.blobs.get(name).ok_or(StateError::NoBlob { sequence: seq, blob: name });
        let listed = restored.manifest.blobs.iter().any(|e| e.name == OPTIMIZER_BLOB);
        if listed && !restored.blobs.contains_key(OPTIMIZER_BLOB) {
            self.model.load(position, blob(MODEL_BLOB)?, &format!("checkpoint {seq}'s model"))?;
            let manifest = restored.record.manifest_sha256.clone();
            self.optimizer = Optim::Committed { config: self.optimizer.config().clone(), sequence: seq, manifest };
            return Ok(());
        }
        self.load(position, blob(MODEL_BLOB)?, blob(OPTIMIZER_BLOB)?, &format!("checkpoint {seq}"))
    }

    /// The state as checkpoint blobs, in host memory: the optimizer's is the whole optimizer's,
    /// or the one gathered for a commit (not copied again).
    pub(crate) fn blobs(&self) -> Result<Vec<Blob>, StateError> {
        let snapshot = |ts: &[(String, Tensor)]| {
            ts.iter().map(|(n, t)| checkpoint::host_copy(n, t)).collect::<Result<Vec<_>, _>>()
        };
        let mut model = snapshot(&self.model.params)?;
        model.extend(snapshot(&self.model.buffers)?);
        let optimizer = match (&self.optimizer, &self.gathered) {
            (Optim::Whole(o), _) => snapshot(&o.state())?,
            (Optim::Sharded(_), Some(gathered)) => gathered.clone(),
            (Optim::Sharded(_), None) => return Err(StateError::Sharded),
            (Optim::Committed { sequence, .. }, _) => return Err(StateError::Unread { sequence: *sequence }),
            // What an unsharded optimizer holds before its first step.
            (Optim::Fresh(config), _) => snapshot(&Optimizer::new(config.clone(), &self.model.params).state())?,
        };
        Ok(vec![
            Blob { name: MODEL_BLOB.into(), tensors: model },
            Blob { name: OPTIMIZER_BLOB.into(), tensors: optimizer },
        ])
    }
}

impl TrainState {
    /// The state's encoding as [`Shareable::encoding`] gives it, with the buffers copied now (a
    /// forward pass changes them in place): a catch-up's snapshot, whose parameters and optimizer
    /// state the caller assembles ([`Encoding::bytes`]) before its update writes them (with the
    /// optimizer state sharded, the parameters are copied now as well).
    pub(crate) fn snapshot_encoding(&self) -> Result<Encoding, StateError> {
        // A sharded step writes the parameters in its reduction (its all-gather), before the
        // caller could wait for the copy: they are copied now too (a third of an Adam state).
        let whole = matches!(self.optimizer, Optim::Whole(_));
        let param = |t: &Tensor| if whole { t.shallow_clone() } else { t.detach().copy() };
        let mut all: Vec<(String, Tensor)> =
            self.model.params.iter().map(|(n, t)| (format!("model/{n}"), param(t))).collect();
        all.extend(self.model.buffers.iter().map(|(n, t)| (format!("model/{n}"), t.detach().copy())));
        all.extend(self.optimizer_tensors());
        Encoding::new(self.magic(), &self.model.position, all)
    }
}

impl Shareable for TrainState {
    fn progress(&self) -> (u64, u64) {
        self.model.progress()
    }

    fn live(&self) -> bool {
        self.model.live
    }

    fn encoding(&self) -> Result<Encoding, StateError> {
        let mut all = self.model.prefixed("model/");
        all.extend(self.optimizer_tensors());
        Encoding::new(self.magic(), &self.model.position, all)
    }
}

/// A state's bytes: its position, the model's tensors and the optimizer's (names without their
/// prefix), and what they hold of the optimizer state.
struct Decoded {
    position: Position,
    model: Vec<TensorData>,
    optim: Vec<TensorData>,
    kind: Carried,
}

/// What a state's bytes carry of its optimizer state.
enum Carried {
    /// All of it.
    Whole,
    /// Nothing: it is sharded, or not made yet.
    Sharded,
    /// The sequence of the commit that holds it and its manifest's sha256 ([`Optim::Committed`]).
    Committed(u64, String),
}

/// An [`Encoding`]'s bytes whose magic is one of `magics`, taken apart: the magic, the position
/// and the tensors.
pub(super) fn split(bytes: &Bytes, magics: &[&[u8; 8]]) -> Result<([u8; 8], Position, Vec<TensorData>), StateError> {
    let magic = bytes.get(..8).filter(|m| magics.iter().any(|k| *m == &k[..]));
    let Some(magic) = magic.filter(|_| bytes.len() >= 16) else {
        return Err(StateError::Invalid("no header"));
    };
    let magic: [u8; 8] = magic.try_into().expect("8 bytes");
    let len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
    let position_end =
        16usize.checked_add(len).filter(|&e| e <= bytes.len()).ok_or(StateError::Invalid("short header"))?;
    let position: Position = serde_json::from_slice(&bytes[16..position_end]).map_err(StateError::InvalidPosition)?;
    let all = tensors::decode(&bytes.slice(position_end..)).map_err(StateError::InvalidTensors)?;
    Ok((magic, position, all))
}

/// [`Shareable::encode`]'s bytes, taken apart.
fn decode(bytes: Bytes) -> Result<Decoded, StateError> {
    let (magic, position, all) = split(&bytes, &[MAGIC, SHARDED_MAGIC, COMMITTED_MAGIC])?;
    let sharded = &magic == SHARDED_MAGIC;
    let (model, optim): (Vec<TensorData>, Vec<TensorData>) =
        all.into_iter().partition(|t| t.name.starts_with("model/"));
    if &magic == COMMITTED_MAGIC {
        let named = |name: &str, dtype| optim.iter().find(|t| t.name == name && t.dtype == dtype);
        let sequence = named(SEQUENCE_TENSOR, trainerd_storage::Dtype::I64).and_then(|t| t.data[..].try_into().ok());
        let manifest = named(MANIFEST_TENSOR, trainerd_storage::Dtype::U8).map(|t| String::from_utf8(t.data.to_vec()));
        let (Some(sequence), Some(Ok(manifest)), 2) = (sequence, manifest, optim.len()) else {
            return Err(StateError::Invalid("a committed optimizer state without its commit's sequence and digest"));
        };
        let kind = Carried::Committed(u64::from_le_bytes(sequence), manifest);
        return Ok(Decoded { position, model: strip_prefix(model, "model/"), optim: Vec::new(), kind });
    }
    let optim = strip_prefix(optim, "optimizer/");
    if sharded && !optim.is_empty() {
        return Err(StateError::Invalid("optimizer tensors in a state whose optimizer state is sharded"));
    }
    let kind = if sharded { Carried::Sharded } else { Carried::Whole };
    Ok(Decoded { position, model: strip_prefix(model, "model/"), optim, kind })
}

/// Tensors named `PREFIXNAME`, named `NAME`.
fn strip_prefix(ts: Vec<TensorData>, prefix: &str) -> Vec<TensorData> {
    ts.into_iter().map(|t| TensorData { name: t.name[prefix.len()..].to_string(), ..t }).collect()
}

#[cfg(test)]
mod tests;
