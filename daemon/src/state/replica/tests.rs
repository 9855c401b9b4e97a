use super::*;
use crate::state::Totals;
use tch::Kind;
use trainerd_sdk::OptimizerConfig;

fn state(seed: i64, config: OptimizerConfig) -> TrainState {
    tch::manual_seed(seed);
    let params = vec![
        ("a".to_string(), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
        ("b".to_string(), Tensor::randn([5], (Kind::Double, Device::Cpu)).set_requires_grad(true)),
    ];
    let optimizer = Optimizer::new(config, &params);
    TrainState::new(ModelState::new((params, typed_buffers(seed)), 1, Device::Cpu, true), optimizer)
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

fn digest(s: &dyn Shareable) -> String {
    s.digest().unwrap()
}

#[test]
fn every_dtype_crosses_a_transfer_and_a_checkpoint_bit_exactly() {
    let mut source = state(1, OptimizerConfig::adam(1e-3));
    train(&mut source, 2);
    // A transfer to a peer (what a recovery broadcasts).
    let mut peer = state(2, OptimizerConfig::adam(1e-3));
    peer.decode(source.encode().unwrap().into()).unwrap();
    assert_eq!(bytes_of(&peer.model.buffers), bytes_of(&source.model.buffers));
    assert_eq!(bytes_of(&peer.model.params), bytes_of(&source.model.params));
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
    restored.load(source.position().clone(), &files[0], &files[1], "checkpoint 1").unwrap();
    assert_eq!(bytes_of(&restored.model.buffers), bytes_of(&source.model.buffers));
    assert_eq!(digest(&restored), digest(&source));
    // Values float32 would have rounded are there exactly.
    let buffers = &restored.model.buffers;
    assert_eq!(Vec::<i64>::try_from(&buffers[0].1).unwrap(), [(1i64 << 53) + 2, i64::MAX - 1]);
    assert_eq!(f64::try_from(&buffers[3].1.get(0)).unwrap(), 1.0 / 3.0 + 1.0);
}

#[test]
fn the_streamed_encoding_is_the_safetensors_form_and_its_digest_the_bytes_sha256() {
    let mut s = state(1, OptimizerConfig::adam(1e-3));
    train(&mut s, 2);
    // Larger than one streamed piece, and a non-contiguous view.
    let big = Tensor::arange(super::super::host::PIECE_FOR_TESTS + 5, (Kind::Float, Device::Cpu));
    s.model.buffers.push(("big".into(), big));
    s.model.buffers.push(("t".into(), Tensor::randn([3, 5], (Kind::Double, Device::Cpu)).transpose(0, 1)));
    let mut copies: Vec<TensorData> =
        s.model.variables().map(|(n, t)| checkpoint::host_copy(&format!("model/{n}"), t).unwrap()).collect();
    let Optim::Whole(o) = &s.optimizer else { unreachable!() };
    copies.extend(o.state().iter().map(|(n, t)| checkpoint::host_copy(&format!("optimizer/{n}"), t).unwrap()));
    let position = serde_json::to_vec(s.position()).unwrap();
    let mut expected = MAGIC.to_vec();
    expected.extend_from_slice(&(position.len() as u64).to_le_bytes());
    expected.extend_from_slice(&position);
    tensors::encode(&copies).unwrap().iter().for_each(|c| expected.extend_from_slice(c));
    let bytes = s.encode().unwrap();
    assert!(bytes == expected, "the encoding is magic, position, then safetensors");
    assert_eq!(s.digest().unwrap(), sha256_hex(&bytes));
    assert_eq!(s.model.digest().unwrap(), sha256_hex(&s.model.encode().unwrap()));
}

#[test]
fn a_sharded_runs_fresh_state_holds_no_optimizer_state_and_commits_the_unsharded_bytes() {
    let config = OptimizerConfig::adam(1e-3);
    let whole = state(1, config.clone());
    let fresh = |seed| {
        let s = state(seed, config.clone());
        TrainState::fresh(s.model, config.clone())
    };
    let source = fresh(1);
    assert_eq!(source.optimizer.state_bytes(), 0);
    // What it sends holds no optimizer tensors; a fresh peer takes it and stays fresh.
    let mut peer = fresh(2);
    peer.model.live = false;
    peer.decode(source.encode().unwrap().into()).unwrap();
    assert!(matches!(peer.optimizer, Optim::Fresh(_)), "{:?}", peer.optimizer);
    assert_eq!(digest(&peer), digest(&source));
    // Committed before its first step, it is the unsharded optimizer's start.
    let blob = |s: &TrainState| s.blobs().unwrap()[1].tensors.clone();
    assert_eq!(blob(&source), blob(&whole));
    assert!(!blob(&source).is_empty());
}

/// A commit of plain SGD holds no optimizer tensors: restored into a sharded state, it is the
/// whole (empty) state, not a sharded state's bytes (which left every member holding no range
/// and sent the cluster back to the same commit for ever). A peer's state says its kind: a
/// sharded one makes a whole receiver sharded (the soak's restarted coordinator, which had
/// restored a commit, stayed whole and sent every member back to it; with Adam it could not
/// take the state at all), a whole one makes a sharded receiver whole, whatever the rule.
#[test]
fn a_state_takes_the_kind_of_optimizer_state_its_source_holds() {
    let sgd = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    for config in [sgd, OptimizerConfig::adam(1e-3)] {
        let sharded = |seed| {
            let mut t = state(seed, config.clone());
            let params: Vec<_> = t.model.params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            t.optimizer = Optim::Sharded(ShardedOptimizer::new(config.clone(), &params, (&[], &[])));
            t
        };
        let mut whole_source = state(1, config.clone());
        train(&mut whole_source, 2);
        let blobs = whole_source.blobs().unwrap();
        assert_eq!(blobs[1].tensors.is_empty(), matches!(config, OptimizerConfig::Sgd { .. }));
        let mut restored = sharded(2);
        restored.load(whole_source.position().clone(), &blobs[0].tensors, &blobs[1].tensors, "checkpoint 1").unwrap();
        assert!(matches!(restored.optimizer, Optim::Whole(_)), "{:?}", restored.optimizer);
        // A sharded source at the same step: its bytes differ from the whole state's by the
        // kind alone, which the receiver takes with them.
        let mut sharded_source = sharded(4);
        let bytes = whole_source.encode().unwrap();
        sharded_source.decode(bytes.clone().into()).unwrap();
        assert!(matches!(sharded_source.optimizer, Optim::Whole(_)), "{:?}", sharded_source.optimizer);
        sharded_source.optimizer = sharded(5).optimizer;
        let sharded_bytes = sharded_source.encode().unwrap();
        assert_ne!(digest(&sharded_source), digest(&whole_source));
        assert!(!restored.same_kind(&sharded_bytes) && restored.same_kind(&bytes));
        restored.decode(sharded_bytes.into()).unwrap();
        assert!(matches!(restored.optimizer, Optim::Sharded(_)), "{:?}", restored.optimizer);
        assert_eq!(digest(&restored), digest(&sharded_source));
        assert_eq!(restored.model.params_sha256(), whole_source.model.params_sha256());
    }
}

#[test]
fn a_sharded_state_with_optimizer_tensors_is_refused() {
    let mut whole = state(1, OptimizerConfig::adam(1e-3));
    train(&mut whole, 1);
    let mut bytes = whole.encode().unwrap();
    bytes[..8].copy_from_slice(SHARDED_MAGIC);
    let err = state(2, OptimizerConfig::adam(1e-3)).decode(bytes.into()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the state received is not valid: optimizer tensors in a state whose optimizer state is sharded"
    );
}

#[test]
fn buffers_saved_before_a_step_are_put_back_exactly() {
    let mut s = state(1, OptimizerConfig::adam(1e-3)).model;
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
        for (_, p) in s.model.params.iter_mut() {
            p.zero_grad();
            (p.pow_tensor_scalar(2).sum(p.kind()) * 0.5).backward();
        }
        let Optim::Whole(o) = &mut s.optimizer else { unreachable!() };
        o.step(&mut s.model.params, 0.01);
        s.model.position.stepped(&Totals::of_batch(1, 0.1, vec![0.0]));
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
        fresh.model.live = false;
        assert_eq!(fresh.digest().unwrap(), "", "a fresh process reports no state");
        fresh.decode(bytes.into()).unwrap();
        assert_eq!(digest(&fresh), digest(&source));
        assert_eq!(fresh.position(), source.position());
        // Both continue with the very same updates (f64 parameters included).
        train(&mut source, 3);
        train(&mut fresh, 3);
        assert_eq!(fresh.encode().unwrap(), source.encode().unwrap(), "{config:?}");
    }
}

#[test]
fn a_model_state_crosses_alone_for_an_evaluation() {
    let mut source = state(1, OptimizerConfig::adam(1e-3));
    train(&mut source, 2);
    let mut fresh = state(2, OptimizerConfig::adam(1e-3)).model;
    fresh.live = false;
    fresh.decode(source.model.encode().unwrap().into()).unwrap();
    assert_eq!(fresh.params_sha256(), source.model.params_sha256());
    assert_eq!((fresh.live, &fresh.position), (true, source.position()));
}

#[test]
fn a_state_of_another_model_is_refused_naming_the_tensor() {
    let source = state(1, OptimizerConfig::adam(1e-3));
    let mut other = state(1, OptimizerConfig::adam(1e-3));
    other.model.params[0].1 = Tensor::zeros([4, 3], (Kind::Float, Device::Cpu));
    assert_eq!(
        other.decode(source.encode().unwrap().into()).unwrap_err().to_string(),
        "the received state's model tensor a has shape [3, 4], the model's has [4, 3]"
    );
    assert_eq!(
        other.decode(Bytes::from_static(b"garbage")).unwrap_err().to_string(),
        "the state received is not valid: no header"
    );
}

/// A commit as a sharded run's restore reads it: its model blob read, its optimizer blob listed
/// in the manifest and left out (verified as a stream, to be read by range).
fn restored_without_optimizer(source: &TrainState, sequence: u64) -> Restored {
    let entry =
        |name: &str| serde_json::json!({"name": name, "path": format!("data/x/{name}"), "size": 1, "sha256": "00"});
    let manifest = serde_json::json!({"format": "trainerd-checkpoint-v1", "generation": 1, "global_step": 0,
        "epoch": 0, "created_unix_ms": 0, "meta": {}, "blobs": [entry(MODEL_BLOB), entry(OPTIMIZER_BLOB)]});
    let record = serde_json::json!({"sequence": sequence, "generation": 1, "manifest": "data/x/manifest.json",
        "manifest_sha256": "ab".repeat(32), "manifest_size": 1, "global_step": 0, "epoch": 0, "bytes": 2,
        "created_unix_ms": 0});
    let model = source.blobs().unwrap().remove(0);
    Restored {
        record: serde_json::from_value(record).unwrap(),
        manifest: serde_json::from_value(manifest).unwrap(),
        blobs: [(model.name, model.tensors)].into_iter().collect(),
        fallbacks: Vec::new(),
    }
}

/// A sharded run's restore leaves the optimizer state in the commit: the state is the commit's
/// (its sequence and manifest digest), its bytes carry them to a peer, which then holds the same
/// state (the same digest: members gone back to one commit receive nothing), and it cannot be
/// committed before each member has read its ranges. A committed state's bytes without the
/// commit are refused.
#[test]
fn a_committed_optimizer_state_crosses_a_transfer_as_its_commits_sequence_and_digest() {
    let config = OptimizerConfig::adam(1e-3);
    let mut source = state(1, config.clone());
    train(&mut source, 2);
    let position = source.position().clone();
    let mut restored = state(2, config.clone());
    restored.restore(&restored_without_optimizer(&source, 7), position).unwrap();
    let Optim::Committed { sequence, manifest, .. } = &restored.optimizer else { panic!("{:?}", restored.optimizer) };
    assert_eq!((*sequence, manifest.as_str()), (7, "ab".repeat(32).as_str()));
    assert_eq!(bytes_of(&restored.model.params), bytes_of(&source.model.params));
    assert_eq!(restored.optimizer.state_bytes(), 0);
    let mut peer = state(3, config.clone());
    peer.model.live = false;
    peer.decode(restored.encode().unwrap().into()).unwrap();
    assert!(matches!(&peer.optimizer, Optim::Committed { sequence: 7, manifest, .. } if manifest == &"ab".repeat(32)));
    assert_eq!(digest(&peer), digest(&restored));
    assert_ne!(digest(&peer), digest(&source), "a whole state is another kind");
    assert!(!peer.same_kind(&source.encode().unwrap()) && peer.same_kind(&restored.encode().unwrap()));
    let err = peer.blobs().unwrap_err().to_string();
    assert_eq!(err, "the optimizer state is checkpoint 7's, not read yet: each member reads its own ranges of it");
    // Its bytes without the commit's sequence are not a state.
    let mut bytes = restored.encode().unwrap();
    let at = bytes.windows(SEQUENCE_TENSOR.len()).position(|w| w == SEQUENCE_TENSOR.as_bytes()).unwrap();
    bytes[at] = b'X';
    let err = peer.decode(bytes.into()).unwrap_err().to_string();
    assert_eq!(
        err,
        "the state received is not valid: a committed optimizer state without its commit's sequence and digest"
    );
}
