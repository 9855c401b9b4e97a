//! One conformance suite, every backend: memory, a local directory, and a real S3-compatible
//! server (SeaweedFS on loopback, started here). Commit then restore gives bit-identical
//! tensors; a commit stopped at any write leaves a complete, verified latest; a flipped byte
//! fails verification and restore falls back; of two chiefs racing for a sequence exactly one
//! wins; an older generation cannot commit; retention keeps the newest K; transient errors are
//! retried.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use proptest::prelude::*;
use trainerd_storage::{
    Blob, CheckpointStore, Dtype, Mode, NewCheckpoint, Part, Retry, Score, Slice, StorageError, TensorData,
};
use trainerd_testkit::fault::FaultStore;
use trainerd_testkit::s3::S3Server;

/// A backend under test: the raw store, the root inside it, and what keeps it alive.
struct Backend {
    name: &'static str,
    raw: Arc<dyn ObjectStore>,
    root: Path,
    _dir: Option<tempfile::TempDir>,
}

static S3: OnceLock<S3Server> = OnceLock::new();

fn s3() -> &'static S3Server {
    S3.get_or_init(|| S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}")))
}

fn backends() -> Vec<Backend> {
    let dir = tempfile::tempdir().unwrap();
    let local = trainerd_storage::location::local_store(dir.path()).unwrap();
    vec![
        Backend {
            name: "memory",
            raw: Arc::new(object_store::memory::InMemory::new()),
            root: Path::default(),
            _dir: None,
        },
        Backend { name: "local", raw: Arc::new(local), root: Path::default(), _dir: Some(dir) },
        Backend {
            name: "s3",
            raw: Arc::new(s3().store().unwrap()),
            root: Path::from(format!("test-{}", uuid::Uuid::new_v4())),
            _dir: None,
        },
    ]
}

impl Backend {
    fn store(&self) -> CheckpointStore {
        CheckpointStore::new(self.raw.clone(), self.root.clone(), self.name)
    }

    fn faulty(&self) -> (FaultStore, CheckpointStore) {
        let fault = FaultStore::new(self.raw.clone());
        let store = CheckpointStore::new(Arc::new(fault.clone()), self.root.clone(), self.name)
            .with_retry(Retry { attempts: 1, ..Retry::default() });
        (fault, store)
    }

    /// Checkpoint data ids that still hold objects.
    async fn data_ids(&self) -> std::collections::BTreeSet<String> {
        trainerd_testkit::fault::data_ids(self.raw.as_ref(), &self.root).await
    }

    fn path(&self, relative: &str) -> Path {
        relative.split('/').fold(self.root.clone(), |p, part| p.join(part))
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn tensor(name: &str, shape: &[usize], seed: u32) -> TensorData {
    let n: usize = shape.iter().product();
    let data: Vec<u8> =
        (0..n as u32).flat_map(|i| (i.wrapping_mul(2654435761) ^ seed).to_le_bytes()).collect::<Vec<u8>>();
    TensorData { name: name.into(), dtype: Dtype::F32, shape: shape.to_vec(), data: Bytes::from(data) }
}

/// A checkpoint at `step`: a small model, optimizer state, and (when `big`) a blob large
/// enough for a multipart upload.
fn checkpoint(step: u64, generation: u64, big: bool) -> NewCheckpoint {
    let seed = step as u32;
    let mut model = vec![tensor("model.dense.weight", &[64, 10], seed), tensor("model.dense.bias", &[10], seed)];
    if big {
        model.push(tensor("model.big", &[9 << 20], seed)); // 36 MiB: a multipart upload of two parts
    }
    NewCheckpoint {
        generation,
        writer: 1,
        global_step: step,
        epoch: step / 100,
        meta: serde_json::json!({"step": step}),
        blobs: vec![
            Blob { name: "model.safetensors".into(), tensors: model },
            Blob {
                name: "optimizer.safetensors".into(),
                tensors: vec![tensor("model.dense.weight/exp_avg", &[64, 10], seed + 1)],
            },
        ],
        score: None,
    }
}

fn tensors_of(c: &NewCheckpoint) -> BTreeMap<String, Vec<TensorData>> {
    c.blobs
        .iter()
        .map(|b| {
            let mut t = b.tensors.clone();
            t.sort_by(|a, b| a.name.cmp(&b.name));
            (b.name.clone(), t)
        })
        .collect()
}

#[test]
fn commit_then_restore_is_bit_identical() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(async {
            assert!(store.latest().await.unwrap().is_none(), "{}", b.name);
            let c = checkpoint(100, 1, true);
            let record = store.commit(&c, 0).await.unwrap();
            assert_eq!((record.sequence, record.global_step, record.epoch), (1, 100, 1));
            let restored = store.latest().await.unwrap().unwrap();
            assert_eq!(restored.blobs, tensors_of(&c), "{}", b.name);
            assert_eq!(restored.manifest.meta, c.meta);
            assert!(restored.fallbacks.is_empty());
            let listed = store.list().await.unwrap();
            assert_eq!(listed, vec![record]);
        });
    }
}

/// Stops a commit at every write point in turn: the visible latest is always a complete,
/// verified commit (the previous one or the new one), a multipart upload that failed was
/// aborted, and the next commit cleans up. Every backend, S3 too, with a multipart blob.
#[test]
fn a_commit_stopped_at_any_write_leaves_a_complete_latest() {
    let rt = rt();
    for b in backends() {
        rt.block_on(async {
            let base = checkpoint(1, 1, false);
            b.store().commit(&base, 0).await.unwrap();
            let next = checkpoint(2, 1, true);
            // How many writes a full commit makes.
            let (fault, counting) = b.faulty();
            counting.commit(&next, 0).await.unwrap();
            let writes = fault.writes();
            // The multipart blob comes first: 4 writes (start, two parts, complete), every one
            // of them a crash point below.
            assert!(writes >= 7, "{}: {writes} writes", b.name);
            assert_eq!(fault.aborts(), 0);
            for crash in 0..writes {
                let (fault, store) = b.faulty();
                fault.crash_at(crash);
                let result = store.commit(&next, 0).await;
                // Once the upload exists, a failed part or completion aborts it.
                let aborted = usize::from((1..=3).contains(&crash));
                assert_eq!(fault.aborts(), aborted, "{}: crash at write {crash}", b.name);
                let latest = b.store().latest().await.unwrap().unwrap_or_else(|| panic!("{}: nothing visible", b.name));
                assert!(latest.fallbacks.is_empty(), "{}: crash at {crash}: {:?}", b.name, latest.fallbacks);
                let expected = if result.is_ok() { tensors_of(&next) } else { latest.blobs.clone() };
                assert_eq!(latest.blobs, expected, "{}: crash at write {crash}", b.name);
                assert!(
                    latest.blobs == tensors_of(&next) || latest.blobs == tensors_of(&base),
                    "{}: crash at write {crash}: latest is neither commit",
                    b.name
                );
            }
            // A clean commit afterwards leaves no data behind but its retained commits'.
            let store = b.store();
            store.commit(&checkpoint(3, 1, false), 1).await.unwrap();
            assert_eq!(b.data_ids().await.len(), 1, "{}", b.name);
        });
    }
}

fn flip(raw: &Arc<dyn ObjectStore>, rt: &tokio::runtime::Runtime, path: &Path, at: usize) {
    rt.block_on(async {
        let mut bytes = raw.get(path).await.unwrap().bytes().await.unwrap().to_vec();
        let i = at % bytes.len();
        bytes[i] ^= 0x01;
        raw.put(path, PutPayload::from(bytes)).await.unwrap();
    });
}

#[test]
fn a_flipped_byte_fails_verification_and_restore_falls_back() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        let (first, second) = (checkpoint(10, 1, false), checkpoint(20, 1, false));
        rt.block_on(store.commit(&first, 0)).unwrap();
        let record = rt.block_on(store.commit(&second, 0)).unwrap();
        let manifest = rt.block_on(store.load(2)).unwrap().manifest;
        let blob = &manifest.blobs[0];
        flip(&b.raw, &rt, &b.path(&blob.path), 1000);
        let err = rt.block_on(store.load(2)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}: commit 2: blob model.safetensors ({}): sha256 ", b.name, blob.path)),
            "{}: {err}",
            b.name
        );
        assert!(err.contains(&format!("the manifest expects {}", blob.sha256)), "{err}");
        let restored = rt.block_on(store.latest()).unwrap().unwrap();
        assert_eq!(restored.record.sequence, 1, "{}", b.name);
        assert_eq!(restored.blobs, tensors_of(&first));
        assert_eq!(restored.fallbacks, vec![err]);
        // A damaged manifest is caught by the commit record's hash.
        flip(&b.raw, &rt, &b.path(&record.manifest), 5);
        let err = rt.block_on(store.load(2)).unwrap_err().to_string();
        assert!(err.contains(&format!("manifest {}: sha256 ", record.manifest)), "{err}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any single flipped byte in any blob or manifest of the newest commit is detected, and
    /// restore falls back to the previous commit.
    #[test]
    fn any_corruption_is_detected(which in 0usize..3, at in any::<usize>()) {
        let rt = rt();
        let raw: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let store = CheckpointStore::new(raw.clone(), Path::default(), "memory");
        let first = checkpoint(1, 1, false);
        rt.block_on(store.commit(&first, 0)).unwrap();
        let record = rt.block_on(store.commit(&checkpoint(2, 1, false), 0)).unwrap();
        let manifest = rt.block_on(store.load(2)).unwrap().manifest;
        let target = match which {
            0 => manifest.blobs[0].path.clone(),
            1 => manifest.blobs[1].path.clone(),
            _ => record.manifest.clone(),
        };
        flip(&raw, &rt, &Path::from(target), at);
        prop_assert!(rt.block_on(store.load(2)).is_err());
        let restored = rt.block_on(store.latest()).unwrap().unwrap();
        prop_assert_eq!(restored.record.sequence, 1);
        prop_assert_eq!(restored.blobs, tensors_of(&first));
    }
}

#[test]
fn of_two_chiefs_racing_for_a_sequence_exactly_one_wins() {
    let rt = rt();
    for b in backends() {
        let (a, c) = (b.store(), b.store());
        for round in 0..5u64 {
            rt.block_on(async {
                let seq_a = a.next_sequence(1, 1).await.unwrap();
                let seq_c = c.next_sequence(1, 1).await.unwrap();
                assert_eq!(seq_a, seq_c);
                let (ca, cc) = (checkpoint(round * 2, 1, false), checkpoint(round * 2 + 1, 1, false));
                let (ra, rc) = tokio::join!(a.commit_sequence(seq_a, &ca, 0), c.commit_sequence(seq_c, &cc, 0));
                let wins = [ra.is_ok(), rc.is_ok()].iter().filter(|w| **w).count();
                assert_eq!(wins, 1, "{}: round {round}: {ra:?} / {rc:?}", b.name);
                let loser = ra.err().or(rc.err()).unwrap();
                assert!(matches!(loser, StorageError::LostRace { sequence, .. } if sequence == seq_a), "{loser}");
                let latest = a.latest().await.unwrap().unwrap();
                assert_eq!(latest.record.sequence, seq_a);
            });
        }
    }
}

#[test]
fn an_older_generation_cannot_commit_over_a_newer_one() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(store.commit(&checkpoint(1, 2, false), 0)).unwrap();
        let err = rt.block_on(store.commit(&checkpoint(2, 1, false), 0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: commit refused: commit 1 was made by generation 2 (writer 1) and this writer is generation 1 \
                 (writer 1); a newer chief has taken over",
                b.name
            )
        );
        assert_eq!(rt.block_on(store.latest()).unwrap().unwrap().record.global_step, 1);
    }
}

#[test]
fn of_two_chiefs_of_one_generation_the_first_to_commit_fences_the_other() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(store.commit(&checkpoint(1, 3, false), 0)).unwrap();
        let other = NewCheckpoint { writer: 2, ..checkpoint(2, 3, false) };
        let err = rt.block_on(store.commit(&other, 0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: commit refused: commit 1 was made by generation 3 (writer 1) and this writer is generation 3 \
                 (writer 2); another chief of the same generation committed first",
                b.name
            )
        );
        // The first goes on.
        rt.block_on(store.commit(&checkpoint(3, 3, false), 0)).unwrap();
    }
}

#[test]
fn no_commit_is_made_over_a_newest_record_that_cannot_be_read() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(store.commit(&checkpoint(1, 5, false), 0)).unwrap();
        let record = b.path("commits/00000000000000000002.json");
        rt.block_on(b.raw.put(&record, PutPayload::from_static(b"{not json"))).unwrap();
        let err = rt.block_on(store.commit(&checkpoint(2, 1, false), 0)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: commit 2: commit record commits/00000000000000000002.json is not valid: ",
                b.name
            )),
            "{err}"
        );
        assert!(err.ends_with("; no commit is made over a newest record that cannot be read (its generation is unknown): repair or remove it"), "{err}");
    }
}

/// Commits rely on create-if-absent: a server that ignores it is found out before any commit,
/// and the probe leaves nothing behind.
#[test]
fn a_server_that_ignores_create_if_absent_is_found_out() {
    let rt = rt();
    for b in backends() {
        rt.block_on(async {
            b.store().probe_create_if_absent("the test server").await.unwrap_or_else(|e| panic!("{}: {e}", b.name));
            let (fault, store) = b.faulty();
            fault.ignore_conditions();
            let err = store.probe_create_if_absent("http://127.0.0.1:9").await.unwrap_err().to_string();
            let start = format!(
                "{}: http://127.0.0.1:9 does not honour create-if-absent writes: a second create of .trainerd-probe-",
                b.name
            );
            assert!(err.starts_with(&start), "{err}");
            assert!(
                err.ends_with(
                    " succeeded, where it must be refused (If-None-Match: *, HTTP 412 Precondition Failed); two \
                     chiefs could then overwrite each other's commits, so none is made there (use a server with \
                     conditional writes, or --s3-skip-probe at your own risk)"
                ),
                "{err}"
            );
            use futures::TryStreamExt;
            let left: Vec<_> = b.raw.list(Some(&b.root)).try_collect().await.unwrap();
            assert!(left.is_empty(), "{}: the probe left {left:?}", b.name);
        });
    }
}

/// A chief starting from storage takes a generation above every writer's, the ones that left
/// only data too; then their data is fenced and its first commit collects it.
#[test]
fn data_left_by_a_newer_writer_raises_the_floor_and_is_then_collected() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(async {
            assert_eq!(store.newest_data_generation().await.unwrap(), 0);
            store.commit(&checkpoint(1, 5, false), 0).await.unwrap();
            // A chief of generation 9 died before its record: only its data is there.
            let left = trainerd_storage::protocol::data_id(9, 2, "died-mid-commit");
            b.raw.put(&b.path(&format!("data/{left}/model.safetensors")), PutPayload::from_static(b"x")).await.unwrap();
            assert_eq!(store.newest_data_generation().await.unwrap(), 9, "{}", b.name);
            // Below the floor it is another writer's commit in flight: spared.
            store.commit(&checkpoint(2, 5, false), 0).await.unwrap();
            assert!(b.data_ids().await.contains(&left), "{}", b.name);
            // Above it, fenced: collected.
            store.commit(&checkpoint(3, 10, false), 0).await.unwrap();
            assert!(!b.data_ids().await.contains(&left), "{}", b.name);
        });
    }
}

/// Collection deletes no data while a record cannot be read (its data is unknown), not even
/// data nothing could publish; retention removing that record ends it.
#[test]
fn while_a_record_cannot_be_read_no_data_is_deleted() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        rt.block_on(async {
            let mut ids = Vec::new();
            for step in 1..=3 {
                ids.push(store.commit(&checkpoint(step, 1, false), 0).await.unwrap().data_id().unwrap().to_string());
            }
            // Record 2 is damaged, and a fenced writer left data behind.
            b.raw
                .put(&b.path("commits/00000000000000000002.json"), PutPayload::from_static(b"{damaged"))
                .await
                .unwrap();
            let fenced = trainerd_storage::protocol::data_id(0, 9, "left-behind");
            b.raw
                .put(&b.path(&format!("data/{fenced}/model.safetensors")), PutPayload::from_static(b"x"))
                .await
                .unwrap();
            let before = b.data_ids().await;
            assert!(before.contains(&ids[1]) && before.contains(&fenced), "{}", b.name);
            let fourth = store.commit(&checkpoint(4, 1, false), 0).await.unwrap();
            let mut expected = before.clone();
            expected.insert(fourth.data_id().unwrap().to_string());
            assert_eq!(b.data_ids().await, expected, "{}: data was deleted beside an unreadable record", b.name);
            // Retention removes the damaged record with the others; then collection goes on.
            let fifth = store.commit(&checkpoint(5, 1, false), 1).await.unwrap();
            assert_eq!(b.data_ids().await, [fifth.data_id().unwrap().to_string()].into(), "{}", b.name);
        });
    }
}

/// Two writers on one prefix (a restarted chief beside a stale one, or two jobs pointed at one
/// place), committing at once with retention on: every record left names data that verifies.
#[test]
fn two_writers_on_one_prefix_never_lose_a_records_data() {
    let rt = rt();
    for b in backends() {
        let (one, two) = (b.store(), b.store());
        for round in 0..20u64 {
            rt.block_on(async {
                // Each round both writers are newer than every record so far, so both upload and
                // race; which of the two is the newer alternates.
                let write = |store: &CheckpointStore, generation: u64, writer: u64| {
                    let store = store.clone();
                    async move {
                        for i in 0..2 {
                            let c = NewCheckpoint { writer, ..checkpoint(round * 10 + i, generation, false) };
                            match store.commit(&c, 2).await {
                                Ok(_) | Err(StorageError::LostRace { .. } | StorageError::Fenced { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                    }
                };
                let (g_one, g_two) = (2 * round + 1 + round % 2, 2 * round + 2 - round % 2);
                tokio::join!(write(&one, g_one, 0xa), write(&two, g_two, 0xb));
                for (seq, record) in one.records().await.unwrap() {
                    record.unwrap_or_else(|e| panic!("{}: round {round}: {e}", b.name));
                    one.load(seq).await.unwrap_or_else(|e| panic!("{}: round {round}: {e}", b.name));
                }
            });
        }
    }
}

#[test]
fn retention_keeps_the_newest_k_and_their_data() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        for step in 1..=5 {
            rt.block_on(store.commit(&checkpoint(step, 1, false), 2)).unwrap();
        }
        let seqs: Vec<u64> = rt.block_on(store.list()).unwrap().iter().map(|r| r.sequence).collect();
        assert_eq!(seqs, [4, 5], "{}", b.name);
        for seq in [4, 5] {
            rt.block_on(store.load(seq)).unwrap();
        }
        assert_eq!(rt.block_on(b.data_ids()).len(), 2, "{}", b.name);
    }
}

/// The best-scored commit is kept beside the newest K, with its data, and its record carries its
/// score (docs/best-checkpoint.md).
#[test]
fn retention_keeps_the_best_scored_commit_and_its_data() {
    let rt = rt();
    for b in backends() {
        let store = b.store();
        let accuracy = [0.70, 0.86, 0.81, 0.86, 0.84];
        for (step, value) in (1..=5).zip(accuracy) {
            let score = Score { metric: "val_accuracy".into(), value, mode: Mode::Max };
            // A commit within the epoch, unscored, then the epoch's end.
            rt.block_on(store.commit(&checkpoint(step * 10 - 5, 1, false), 2)).unwrap();
            rt.block_on(store.commit(&NewCheckpoint { score: Some(score), ..checkpoint(step * 10, 1, false) }, 2))
                .unwrap();
        }
        let records = rt.block_on(store.list()).unwrap();
        let seqs: Vec<u64> = records.iter().map(|r| r.sequence).collect();
        assert_eq!(seqs, [4, 9, 10], "{}: the first 0.86 (sequence 4) beside the newest two", b.name);
        assert_eq!(records[0].score.as_ref().map(|s| s.value), Some(0.86), "{}", b.name);
        assert_eq!(records[0].global_step, 20);
        rt.block_on(store.load(4)).unwrap();
        assert_eq!(rt.block_on(b.data_ids()).len(), 3, "{}", b.name);
    }
}

#[test]
fn transient_errors_are_retried_and_persistent_ones_leave_the_last_commit() {
    let rt = rt();
    for b in backends() {
        let fault = FaultStore::new(b.raw.clone());
        let store = CheckpointStore::new(Arc::new(fault.clone()), b.root.clone(), b.name).with_retry(Retry {
            attempts: 5,
            base: std::time::Duration::from_millis(1),
            max: std::time::Duration::from_millis(5),
        });
        rt.block_on(store.commit(&checkpoint(1, 1, false), 0)).unwrap();
        fault.fail_next(3);
        rt.block_on(store.commit(&checkpoint(2, 1, false), 0)).unwrap();
        fault.crash_at(fault.writes() + 2);
        let err = rt.block_on(store.commit(&checkpoint(3, 1, false), 0)).unwrap_err().to_string();
        assert!(err.contains("crashed before write"), "{err}");
        let latest = rt.block_on(b.store().latest()).unwrap().unwrap();
        assert_eq!(latest.record.global_step, 2, "{}", b.name);
    }
}

/// Three members' parts of a sharded commit at `step`: each holds a third of the model's weight
/// and of its optimizer state as element ranges (member 0 the bias too, whole), cut across rows;
/// and the coordinator's own blob. With the tensors the restore must give.
fn sharded(step: u64) -> (Vec<Part>, NewCheckpoint, BTreeMap<String, Vec<TensorData>>) {
    let whole = checkpoint(step, 1, false);
    let (weight, bias) = (&whole.blobs[0].tensors[0], &whole.blobs[0].tensors[1]);
    let exp_avg = &whole.blobs[1].tensors[0];
    let cuts = [0usize, 213, 426, 640];
    let cut = |t: &TensorData, p: usize| {
        let stored = format!("{}@{}", t.name, cuts[p]);
        let data = t.data.slice(cuts[p] * 4..cuts[p + 1] * 4);
        let slice = Slice { stored: stored.clone(), tensor: t.name.clone(), shape: t.shape.clone(), offset: cuts[p] };
        (TensorData { name: stored, dtype: t.dtype, shape: vec![cuts[p + 1] - cuts[p]], data }, slice)
    };
    let mut parts = Vec::new();
    for p in 0..3 {
        let (mut tensors, mut slices): (Vec<_>, Vec<_>) = [cut(weight, p)].into_iter().unzip();
        if p == 0 {
            let name = format!("{}@0", bias.name);
            tensors.push(TensorData { name: name.clone(), ..bias.clone() });
            slices.push(Slice { stored: name, tensor: bias.name.clone(), shape: bias.shape.clone(), offset: 0 });
        }
        parts.push(Part {
            blob: "model.safetensors".into(),
            file: format!("model.part-{p}.safetensors"),
            tensors,
            slices,
        });
        let (tensors, slices) = [cut(exp_avg, p)].into_iter().unzip();
        parts.push(Part {
            blob: "optimizer.safetensors".into(),
            file: format!("optimizer.part-{p}.safetensors"),
            tensors,
            slices,
        });
    }
    let buffers = Blob { name: "buffers.safetensors".into(), tensors: vec![tensor("model.bn.running_mean", &[10], 3)] };
    let coordinator = NewCheckpoint { blobs: vec![buffers.clone()], ..whole.clone() };
    let mut expected = tensors_of(&whole);
    expected.insert(buffers.name.clone(), buffers.tensors);
    (parts, coordinator, expected)
}

/// A sharded commit: the members write their parts in parallel under the coordinator's data id,
/// then the coordinator commits them with its own blob; the restore puts every tensor back
/// together bit for bit. A crash at any write of any member's part, or of the coordinator's
/// commit, leaves the previous commit the latest (or, past the record, the new one), and the
/// coordinator's next commit collects what a failed one left.
#[test]
fn a_sharded_commit_restores_whole_and_a_crash_at_any_write_of_any_part_leaves_the_last_commit() {
    let rt = rt();
    for b in backends() {
        rt.block_on(async {
            let store = b.store();
            let (parts, coordinator, expected) = sharded(2);
            let base = checkpoint(1, 1, false);
            store.commit(&base, 0).await.unwrap();
            let id = CheckpointStore::new_data_id(1, 1);
            let written = futures::future::try_join_all(parts.iter().map(|p| store.write_part(&id, p))).await.unwrap();
            store.commit_parts(&coordinator, (&id, written.clone()), 0).await.unwrap();
            let restored = store.latest().await.unwrap().unwrap();
            assert_eq!(restored.blobs, expected, "{}", b.name);
            assert_eq!(restored.manifest.blobs.iter().filter(|e| e.slices.is_some()).count(), 6);
            // A member's part cut short at any of its writes: the coordinator hears of no part,
            // writes no record, and the last commit stands.
            for member in 0..parts.len() {
                let (fault, counting) = b.faulty();
                counting.write_part(&CheckpointStore::new_data_id(1, 1), &parts[member]).await.unwrap();
                for crash in 0..fault.writes() {
                    let (fault, faulty) = b.faulty();
                    fault.crash_at(crash);
                    let id = CheckpointStore::new_data_id(1, 1);
                    let others = parts.iter().enumerate().filter(|(m, _)| *m != member);
                    let theirs = others.map(|(_, p)| store.write_part(&id, p));
                    let (mine, theirs) =
                        futures::join!(faulty.write_part(&id, &parts[member]), futures::future::try_join_all(theirs));
                    assert!(mine.is_err() && theirs.is_ok(), "{}: member {member}, crash at {crash}", b.name);
                    let latest = b.store().latest().await.unwrap().unwrap();
                    assert_eq!(latest.blobs, expected, "{}: member {member}, crash at {crash}", b.name);
                }
            }
            // The coordinator's commit cut short at any write: the sharded commit is the latest
            // in full, or the previous one is.
            let (fault, counting) = b.faulty();
            let id = CheckpointStore::new_data_id(1, 1);
            let parts_3 = futures::future::try_join_all(parts.iter().map(|p| store.write_part(&id, p))).await.unwrap();
            let next = NewCheckpoint { global_step: 3, ..coordinator.clone() };
            counting.commit_parts(&next, (&id, parts_3), 0).await.unwrap();
            for crash in 0..fault.writes() {
                let before = b.store().latest().await.unwrap().unwrap().record.sequence;
                let (fault, faulty) = b.faulty();
                fault.crash_at(crash);
                let id = CheckpointStore::new_data_id(1, 1);
                let parts =
                    futures::future::try_join_all(parts.iter().map(|p| store.write_part(&id, p))).await.unwrap();
                let result = faulty.commit_parts(&next, (&id, parts), 0).await;
                let latest = b.store().latest().await.unwrap().unwrap();
                assert_eq!(latest.blobs, expected, "{}: coordinator, crash at {crash}", b.name);
                assert_eq!(latest.record.sequence > before, result.is_ok(), "{}: crash at {crash}", b.name);
            }
            // The coordinator's next commit leaves only its retained commit's data.
            store.commit(&checkpoint(4, 1, false), 1).await.unwrap();
            assert_eq!(b.data_ids().await.len(), 1, "{}", b.name);
        });
    }
}

/// A sharded run's resume (docs/fault-tolerance.md, "A sharded run's resume"): the optimizer's
/// blob is verified as a stream and left out of the restore, and each member reads its ranges of
/// it, from a whole commit and from a sharded one's parts alike (ranges that cross the parts'
/// cuts included), bit for bit. A damaged streamed blob fails the commit as a read one does, and
/// the restore falls back; a range the blob lacks is refused, naming the tensor and elements.
#[test]
fn a_blob_is_read_by_element_range_whole_or_in_parts_and_a_streamed_blob_is_verified() {
    let rt = rt();
    let optimizer = "optimizer.safetensors";
    for b in backends() {
        rt.block_on(async {
            let store = b.store();
            let whole = checkpoint(1, 1, false);
            store.commit(&whole, 0).await.unwrap();
            let (parts, coordinator, expected) = sharded(2);
            let id = CheckpointStore::new_data_id(1, 1);
            let written = futures::future::try_join_all(parts.iter().map(|p| store.write_part(&id, p))).await.unwrap();
            store.commit_parts(&coordinator, (&id, written), 0).await.unwrap();
            let expected_of = |sequence: u64| if sequence == 1 { tensors_of(&whole) } else { expected.clone() };
            for sequence in [1, 2] {
                let restored = store.load_streaming(sequence, &[optimizer]).await.unwrap();
                let mut without = expected_of(sequence);
                let exp_avg = without.remove(optimizer).unwrap().remove(0);
                assert_eq!(restored.blobs, without, "{}: commit {sequence}", b.name);
                let digest = restored.record.manifest_sha256.as_str();
                let ranges = store.blob_ranges((sequence, digest), optimizer).await.unwrap();
                assert_eq!(ranges.names().collect::<Vec<_>>(), [exp_avg.name.as_str()]);
                assert_eq!(ranges.tensor(&exp_avg.name), Some((Dtype::F32, &[64usize, 10][..])));
                let wants = [0..640, 200..430, 639..640, 213..426, 7..7];
                let asked: Vec<(&str, std::ops::Range<usize>)> =
                    wants.iter().map(|r| (exp_avg.name.as_str(), r.clone())).collect();
                let read = ranges.read(&asked).await.unwrap();
                for (r, bytes) in wants.iter().zip(&read) {
                    assert_eq!(bytes[..], exp_avg.data[r.start * 4..r.end * 4], "{}: {sequence}, {r:?}", b.name);
                }
                let err = ranges.read(&[(exp_avg.name.as_str(), 630..650)]).await.unwrap_err().to_string();
                let says = format!(
                    "{}: commit {sequence}: blob {optimizer}: tensor {}, elements 630..650: 10 of them stored",
                    b.name, exp_avg.name
                );
                assert_eq!(err, says);
                let err = ranges.read(&[("model.nothing/exp_avg", 0..1)]).await.unwrap_err().to_string();
                assert!(err.ends_with("tensor model.nothing/exp_avg, elements 0..1: not in the blob"), "{err}");
                // Another commit of that sequence (another location's) is not read.
                let other = if sequence == 1 { "0".repeat(64) } else { "f".repeat(64) };
                let err = store.blob_ranges((sequence, &other), optimizer).await.unwrap_err().to_string();
                let says = format!(
                    "{}: commit {sequence}: its manifest's sha256 is {digest}, the one asked for is {other}: another \
                     commit",
                    b.name
                );
                assert_eq!(err, says);
            }
        });
        // A flipped byte in a streamed blob (the sharded commit's second part of it).
        let store = b.store();
        let manifest = rt.block_on(store.load(2)).unwrap().manifest;
        let entry = manifest.blobs.iter().filter(|e| e.name == optimizer).nth(1).unwrap();
        flip(&b.raw, &rt, &b.path(&entry.path), 40);
        let err = rt.block_on(store.load_streaming(2, &[optimizer])).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: commit 2: blob {optimizer} ({}): sha256 ", b.name, entry.path)));
        let restored = rt.block_on(store.latest_streaming(&[optimizer])).unwrap().unwrap();
        assert_eq!((restored.record.sequence, restored.fallbacks.clone()), (1, vec![err]), "{}", b.name);
    }
}
