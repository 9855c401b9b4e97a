//! `trainerd ckpt list|show|verify|export URL`: operators' view of a checkpoint location.

use std::io::Write;
use std::path::Path;

use trainerd_storage::tensors::TensorData;
use trainerd_storage::{CheckpointStore, CommitRecord, StorageError};

use super::CheckpointError;
use crate::state::MODEL_BLOB;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of a Unix time in milliseconds.
pub(crate) fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The best commit among `records` (docs/best-checkpoint.md), if any is scored.
fn best_of(records: &[(u64, Result<CommitRecord, StorageError>)]) -> Option<u64> {
    trainerd_storage::protocol::best(
        records.iter().map(|(seq, r)| (*seq, r.as_ref().ok().and_then(|r| r.score.as_ref()))),
    )
}

/// The best commit at `store`'s location: refused, saying why, when no commit is scored.
pub(crate) fn best(store: &CheckpointStore) -> Result<u64, CheckpointError> {
    let records = runtime().block_on(store.records())?;
    best_of(&records).ok_or_else(|| CheckpointError::NoBest { location: store.name().into() })
}

/// Lists commits: sequence, step, epoch, time, size, generation, an epoch-end commit's score
/// (`best` beside the best); a record that cannot be read is listed as damaged, with why.
pub(crate) fn list(store: &CheckpointStore) -> Result<String, StorageError> {
    let records = runtime().block_on(store.records())?;
    if records.is_empty() {
        return Ok(format!("{}: no commits\n", store.name()));
    }
    let mut out = format!(
        "{:>8}  {:>10}  {:>5}  {:<19}  {:>10}  {:>10}  score\n",
        "sequence", "step", "epoch", "time (UTC)", "bytes", "generation"
    );
    let best = best_of(&records);
    for (sequence, record) in records {
        let r = match record {
            Ok(r) => r,
            Err(e) => {
                out.push_str(&format!("{sequence:>8}  DAMAGED: {e}\n"));
                continue;
            }
        };
        let score = r.score.as_ref().map_or(String::new(), |s| {
            let best = if best == Some(r.sequence) { "  best" } else { "" };
            format!("  {} {:.4}{best}", s.metric, s.value)
        });
        out.push_str(&format!(
            "{:>8}  {:>10}  {:>5}  {:<19}  {:>10}  {:>10}{score}\n",
            r.sequence,
            r.global_step,
            r.epoch,
            utc(r.created_unix_ms),
            r.bytes,
            r.generation
        ));
    }
    Ok(out)
}

/// The sequence asked for, or the newest.
fn pick(store: &CheckpointStore, rt: &tokio::runtime::Runtime, sequence: Option<u64>) -> Result<u64, StorageError> {
    match sequence {
        Some(s) => Ok(s),
        None => rt
            .block_on(store.list())?
            .last()
            .map(|r| r.sequence)
            .ok_or_else(|| StorageError::NoCommit { location: store.name().into(), detail: String::new() }),
    }
}

/// A commit's record and manifest, as JSON.
pub(crate) fn show(store: &CheckpointStore, sequence: Option<u64>) -> Result<String, StorageError> {
    let rt = runtime();
    let seq = pick(store, &rt, sequence)?;
    let restored = rt.block_on(store.load(seq))?;
    let json = serde_json::json!({"commit": restored.record, "manifest": restored.manifest});
    Ok(serde_json::to_string_pretty(&json).expect("plain data") + "\n")
}

/// Verifies every commit (or one): each line says `ok` or what is damaged. `Ok(false)` when
/// any is damaged.
pub(crate) fn verify(
    store: &CheckpointStore,
    sequence: Option<u64>,
    out: &mut dyn Write,
) -> Result<bool, StorageError> {
    let rt = runtime();
    let sequences: Vec<u64> = match sequence {
        Some(s) => vec![s],
        // Every record present, the unreadable ones too: they are damage to report.
        None => rt.block_on(store.records())?.iter().map(|(seq, _)| *seq).collect(),
    };
    if sequences.is_empty() {
        return Err(StorageError::NoCommit { location: store.name().into(), detail: String::new() });
    }
    let mut all_ok = true;
    for seq in sequences {
        match rt.block_on(store.load(seq)) {
            Ok(r) => {
                let _ = writeln!(
                    out,
                    "commit {seq}: ok ({} blobs, {} bytes, sha256 verified)",
                    r.manifest.blobs.len(),
                    r.record.bytes
                );
            }
            Err(e @ StorageError::Damaged { .. }) => {
                all_ok = false;
                let _ = writeln!(out, "DAMAGED {e}");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(all_ok)
}

/// Writes a commit's parameters as one safetensors file (atomically). Returns a description.
pub(crate) fn export(store: &CheckpointStore, sequence: Option<u64>, output: &Path) -> Result<String, CheckpointError> {
    let rt = runtime();
    let seq = pick(store, &rt, sequence)?;
    let restored = rt.block_on(store.load(seq))?;
    let tensors = restored.blobs.get(MODEL_BLOB).ok_or(CheckpointError::NoBlob { sequence: seq, blob: MODEL_BLOB })?;
    let renamed = exported_names(&restored.manifest.meta, tensors, seq)?;
    let tensors = renamed.as_deref().unwrap_or(tensors);
    let chunks = trainerd_storage::tensors::encode(tensors).map_err(CheckpointError::Encode)?;
    let parts: Vec<&[u8]> = chunks.iter().map(|c| c.as_ref()).collect();
    crate::sys::atomic::write_file(output, &parts)
        .map_err(|source| CheckpointError::Write { path: output.to_path_buf(), source })?;
    Ok(format!(
        "exported commit {seq} (step {}): {} tensors to {}",
        restored.record.global_step,
        tensors.len(),
        output.display()
    ))
}

/// The tensors under the names the plugin gave for export (a Python model's `state_dict()` keys;
/// a tied weight under each of its names), when the checkpoint records them.
fn exported_names(
    meta: &serde_json::Value,
    tensors: &[TensorData],
    sequence: u64,
) -> Result<Option<Vec<TensorData>>, CheckpointError> {
    let names: Vec<(String, String)> = match meta.get("export_names") {
        Some(v) => serde_json::from_value(v.clone()).unwrap_or_default(),
        None => return Ok(None),
    };
    if names.is_empty() {
        return Ok(None);
    }
    let by_name: std::collections::BTreeMap<&str, &TensorData> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let prefix = format!("{}.", crate::plugin::MODEL_PATH);
    names
        .into_iter()
        .map(|(key, variable)| {
            let stored = by_name
                .get(format!("{prefix}{variable}").as_str())
                .ok_or_else(|| CheckpointError::NoTensor { sequence, name: format!("{prefix}{variable}") })?;
            Ok(TensorData { name: key, ..(*stored).clone() })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc(1_795_392_000_000), "2026-11-23 00:00:00");
        assert_eq!(super::utc(951_782_400_000 + 3_723_000), "2000-02-29 01:02:03");
    }
}
