//! The training loop's state as one value: where training stands ([`Position`]), the
//! parameters, the buffers (non-trainable variables such as BatchNorm's running statistics), and
//! the optimizer. It is what a recovering member receives from a live peer
//! ([`TrainState::encode`], [`TrainState::decode`]: raw bytes, every dtype exact, fingerprinted
//! by sha256) and what the chief commits ([`TrainState::blobs`], [`TrainState::restore`]).
//!
//! A step changes it only after its all-reduce has completed on this member, so an abandoned step
//! leaves it exactly at the previous step (buffers that a forward pass updates in place are put
//! back: [`TrainState::save_buffers`]). Every tensor keeps its dtype: float64 and integer state
//! crosses encodes, transfers and checkpoints bit for bit.

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};
use trainerd_storage::{tensors, Blob, Restored, TensorData};

use crate::checkpoint::{self, Position, MODEL_BLOB, OPTIMIZER_BLOB};
use crate::cluster::membership::Report;
use crate::optim::Optimizer;

const MAGIC: &[u8; 8] = b"TRDSTAT1";

/// Named tensors, in name order.
pub type Named = Vec<(String, Tensor)>;

/// Parameters, buffers, optimizer and position of one replica.
pub struct TrainState {
    /// Where training stands.
    pub position: Position,
    /// The model's trainable parameters (shared with the plugin's model), in name order.
    pub params: Vec<(String, Tensor)>,
    /// The model's non-trainable variables (shared with the plugin's model), in name order.
    pub buffers: Vec<(String, Tensor)>,
    /// The optimizer and its state tensors.
    pub optimizer: Optimizer,
    /// False for a process that has not received or restored a state yet (its freshly built
    /// model is not the run's state unless it is the chief's).
    pub live: bool,
    device: Device,
}

impl TrainState {
    /// A state at the start of training.
    pub fn new(
        (params, buffers): (Named, Named),
        optimizer: Optimizer,
        metrics: usize,
        device: Device,
        live: bool,
    ) -> Self {
        TrainState { position: Position::start(metrics), params, buffers, optimizer, live, device }
    }

    /// Every model variable, parameters then buffers.
    pub fn variables(&self) -> impl Iterator<Item = &(String, Tensor)> {
        self.params.iter().chain(&self.buffers)
    }

    /// A copy of every buffer, to put back with [`TrainState::restore_buffers`] when a step is
    /// abandoned after its forward pass updated them. Empty when the model has none.
    pub fn save_buffers(&self) -> Vec<Tensor> {
        self.buffers.iter().map(|(_, b)| b.detach().copy()).collect()
    }

    /// Puts back buffers saved by [`TrainState::save_buffers`].
    pub fn restore_buffers(&mut self, saved: &[Tensor]) {
        let _no_grad = tch::no_grad_guard();
        for ((_, b), s) in self.buffers.iter_mut().zip(saved) {
            b.copy_(s);
        }
    }

    /// How far it is: (global step, epoch), larger is further (the epoch moves on after each
    /// epoch's evaluation).
    pub fn progress(&self) -> (u64, u64) {
        (self.position.global_step, u64::from(self.position.epoch))
    }

    /// Every tensor in host memory: parameters and buffers as `model/NAME`, optimizer state as
    /// `optimizer/NAME`.
    fn host_tensors(&self) -> Result<Vec<TensorData>, String> {
        let model = self.variables().map(|(n, t)| checkpoint::host_copy(&format!("model/{n}"), t));
        let optim =
            self.optimizer.state().into_iter().map(|(n, t)| checkpoint::host_copy(&format!("optimizer/{n}"), &t));
        model.chain(optim).collect()
    }

    /// The state as bytes: magic, the position's JSON (length-prefixed), then safetensors.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let position = serde_json::to_vec(&self.position).map_err(|e| e.to_string())?;
        let chunks = tensors::encode(&self.host_tensors()?).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(16 + position.len() + chunks.iter().map(Bytes::len).sum::<usize>());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(position.len() as u64).to_le_bytes());
        out.extend_from_slice(&position);
        chunks.iter().for_each(|c| out.extend_from_slice(c));
        Ok(out)
    }

    /// The sha256 of [`TrainState::encode`].
    pub fn digest(&self) -> Result<String, String> {
        Ok(hex(&Sha256::digest(self.encode()?)))
    }

    /// What this member tells the cluster when it joins after `generation`.
    pub fn report(&self, generation: u64) -> Result<Report, String> {
        let digest = if self.live { self.digest()? } else { String::new() };
        Ok(Report { generation, progress: self.progress(), digest })
    }

    /// Takes a peer's state from `bytes` (checked against this model: names, types, shapes).
    pub fn decode(&mut self, bytes: &[u8]) -> Result<(), String> {
        let bad = |what: &str| format!("the state received is not valid: {what}");
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err(bad("no header"));
        }
        let len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
        let position_end = 16usize.checked_add(len).filter(|&e| e <= bytes.len()).ok_or_else(|| bad("short header"))?;
        let position: Position = serde_json::from_slice(&bytes[16..position_end]).map_err(|e| bad(&e.to_string()))?;
        let all = tensors::decode(&Bytes::copy_from_slice(&bytes[position_end..])).map_err(|e| bad(&e.to_string()))?;
        let (model, optim): (Vec<TensorData>, Vec<TensorData>) =
            all.into_iter().partition(|t| t.name.starts_with("model/"));
        let strip = |ts: Vec<TensorData>, prefix: &str| -> Vec<TensorData> {
            ts.into_iter().map(|t| TensorData { name: t.name[prefix.len()..].to_string(), ..t }).collect()
        };
        self.load(position, &strip(model, "model/"), &strip(optim, "optimizer/"), "the received state")
    }

    /// Copies parameters, buffers and optimizer state in, and takes `position`; `what` names the
    /// source in messages.
    fn load(
        &mut self,
        position: Position,
        model: &[TensorData],
        optim: &[TensorData],
        what: &str,
    ) -> Result<(), String> {
        checkpoint::copy_into(&mut self.params, model, &format!("{what}'s model"))?;
        checkpoint::copy_into(&mut self.buffers, model, &format!("{what}'s model"))?;
        let state: Vec<(String, Tensor)> = optim
            .iter()
            .map(|t| Ok((t.name.clone(), checkpoint::to_tensor(t)?.to_device(self.device))))
            .collect::<Result<_, String>>()?;
        self.optimizer.restore(position.global_step, &state).map_err(|e| format!("{what}: {e}"))?;
        self.position = position;
        self.live = true;
        Ok(())
    }

    /// Takes a verified checkpoint's state (its metadata already checked against this run).
    pub fn restore(&mut self, restored: &Restored, position: Position) -> Result<(), String> {
        let seq = restored.record.sequence;
        let blob = |name: &str| restored.blobs.get(name).ok_or_else(|| format!("checkpoint {seq} has no {name}"));
        self.load(position, blob(MODEL_BLOB)?, blob(OPTIMIZER_BLOB)?, &format!("checkpoint {seq}"))
    }

    /// Takes only the model (parameters and buffers) of a verified checkpoint, and `position`:
    /// what an evaluation needs, whatever optimizer trained it.
    pub fn restore_model(&mut self, restored: &Restored, position: Position) -> Result<(), String> {
        let seq = restored.record.sequence;
        let model = restored.blobs.get(MODEL_BLOB).ok_or_else(|| format!("checkpoint {seq} has no {MODEL_BLOB}"))?;
        let what = format!("checkpoint {seq}'s model");
        checkpoint::copy_into(&mut self.params, model, &what)?;
        checkpoint::copy_into(&mut self.buffers, model, &what)?;
        self.position = position;
        self.live = true;
        Ok(())
    }

    /// The state as checkpoint blobs, in host memory.
    pub fn blobs(&self) -> Result<Vec<Blob>, String> {
        let snapshot = |ts: &[(String, Tensor)]| {
            ts.iter().map(|(n, t)| checkpoint::host_copy(n, t)).collect::<Result<Vec<_>, _>>()
        };
        let mut model = snapshot(&self.params)?;
        model.extend(snapshot(&self.buffers)?);
        Ok(vec![
            Blob { name: MODEL_BLOB.into(), tensors: model },
            Blob { name: OPTIMIZER_BLOB.into(), tensors: snapshot(&self.optimizer.state())? },
        ])
    }
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;
    use trainerd_sdk::OptimizerConfig;

    fn state(seed: i64, config: OptimizerConfig) -> TrainState {
        tch::manual_seed(seed);
        let params = vec![
            ("a".to_string(), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
            ("b".to_string(), Tensor::randn([5], (Kind::Double, Device::Cpu)).set_requires_grad(true)),
        ];
        let optimizer = Optimizer::new(config, &params);
        TrainState::new((params, typed_buffers(seed)), optimizer, 1, Device::Cpu, true)
    }

    /// Buffers of every dtype a checkpoint holds, with values float32 cannot carry.
    fn typed_buffers(seed: i64) -> Vec<(String, Tensor)> {
        vec![
            ("count".into(), Tensor::from_slice(&[(1i64 << 53) + 1 + seed, i64::MAX - seed])),
            ("index".into(), Tensor::from_slice(&[(1i32 << 24) + 1 + seed as i32, i32::MIN])),
            ("mask".into(), Tensor::from_slice(&[1u8, 255 - seed as u8])),
            ("mean".into(), Tensor::from_slice(&[1.0f64 / 3.0 + seed as f64, 1e-300, f64::MAX])),
            ("half".into(), Tensor::from_slice(&[0.1f32 * seed as f32, 3.0]).to_kind(Kind::Half)),
            ("brain".into(), Tensor::from_slice(&[0.7f32 * seed as f32]).to_kind(Kind::BFloat16)),
        ]
    }

    fn bytes_of(ts: &[(String, Tensor)]) -> Vec<(String, Kind, Vec<u8>)> {
        ts.iter().map(|(n, t)| (n.clone(), t.kind(), checkpoint::host_bytes(t).unwrap())).collect()
    }

    #[test]
    fn every_dtype_crosses_a_transfer_and_a_checkpoint_bit_exactly() {
        let mut source = state(1, OptimizerConfig::adam(1e-3));
        train(&mut source, 2);
        // A transfer to a peer (what a recovery broadcasts).
        let mut peer = state(2, OptimizerConfig::adam(1e-3));
        peer.decode(&source.encode().unwrap()).unwrap();
        assert_eq!(bytes_of(&peer.buffers), bytes_of(&source.buffers));
        assert_eq!(bytes_of(&peer.params), bytes_of(&source.params));
        // A checkpoint: the blobs as safetensors files, read back.
        let blobs = source.blobs().unwrap();
        let files: Vec<Vec<TensorData>> = blobs
            .iter()
            .map(|b| {
                let chunks = tensors::encode(&b.tensors).unwrap();
                tensors::decode(&Bytes::from(chunks.concat())).unwrap()
            })
            .collect();
        let mut restored = state(3, OptimizerConfig::adam(1e-3));
        restored.load(source.position.clone(), &files[0], &files[1], "checkpoint 1").unwrap();
        assert_eq!(bytes_of(&restored.buffers), bytes_of(&source.buffers));
        assert_eq!(restored.digest().unwrap(), source.digest().unwrap());
        // Values float32 would have rounded are there exactly.
        assert_eq!(Vec::<i64>::try_from(&restored.buffers[0].1).unwrap(), [(1i64 << 53) + 2, i64::MAX - 1]);
        assert_eq!(f64::try_from(&restored.buffers[3].1.get(0)).unwrap(), 1.0 / 3.0 + 1.0);
    }

    #[test]
    fn buffers_saved_before_a_step_are_put_back_exactly() {
        let mut s = state(1, OptimizerConfig::adam(1e-3));
        let before = bytes_of(&s.buffers);
        let saved = s.save_buffers();
        for (_, b) in s.buffers.iter_mut() {
            let _ = b.fill_(7);
        }
        assert_ne!(bytes_of(&s.buffers), before);
        s.restore_buffers(&saved);
        assert_eq!(bytes_of(&s.buffers), before);
    }

    fn train(s: &mut TrainState, steps: u64) {
        for _ in 0..steps {
            for (_, p) in s.params.iter_mut() {
                p.zero_grad();
                (p.pow_tensor_scalar(2).sum(p.kind()) * 0.5).backward();
            }
            s.optimizer.step(&mut s.params, 0.01);
            s.position.global_step += 1;
            s.position.step_in_epoch += 1;
            s.position.totals[0] += 0.1;
        }
    }

    #[test]
    fn a_state_sent_to_a_fresh_replica_is_bit_identical_and_continues_identically() {
        for config in [
            OptimizerConfig::adam(1e-3),
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.5, weight_decay: 0.0, nesterov: false },
        ] {
            let mut source = state(1, config.clone());
            train(&mut source, 7);
            let bytes = source.encode().unwrap();
            let mut fresh = state(2, config.clone());
            fresh.live = false;
            assert_eq!(fresh.report(0).unwrap().digest, "", "a fresh process reports no state");
            fresh.decode(&bytes).unwrap();
            assert_eq!(fresh.digest().unwrap(), source.digest().unwrap());
            assert_eq!(fresh.position, source.position);
            // Both continue with the very same updates (f64 parameters included).
            train(&mut source, 3);
            train(&mut fresh, 3);
            assert_eq!(fresh.encode().unwrap(), source.encode().unwrap(), "{config:?}");
        }
    }

    #[test]
    fn a_state_of_another_model_is_refused_naming_the_tensor() {
        let source = state(1, OptimizerConfig::adam(1e-3));
        let mut other = state(1, OptimizerConfig::adam(1e-3));
        other.params[0].1 = Tensor::zeros([4, 3], (Kind::Float, Device::Cpu));
        assert_eq!(
            other.decode(&source.encode().unwrap()).unwrap_err(),
            "the received state's model tensor a has shape [3, 4], the model's has [4, 3]"
        );
        assert_eq!(other.decode(b"garbage").unwrap_err(), "the state received is not valid: no header");
    }
}
