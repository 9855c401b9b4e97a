//! The last state every member agreed on, which a member goes back to alone when a later
//! comparison finds a replica corrupted. It is written, as it is encoded, to an unnamed file in
//! the worker's state directory (`$TMPDIR` without one), not held in memory, so that comparing the
//! replicas costs no resident copy of the state (12 bytes a parameter with Adam): the page cache
//! holds it while memory is free, and gives it up when it is not. The file is of use to this
//! process alone and vanishes with it. Where it cannot be written (a full disk), the bytes are
//! kept in memory instead, as before, and nothing is lost.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use bytes::Bytes;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::state::{Shareable, StateError, TrainState};

/// Bytes written to the file at a time.
const BUFFER: usize = 1 << 20;

/// Where the agreed state's bytes are.
enum Kept {
    /// In an unnamed file.
    File(File),
    /// In memory (the file could not be written).
    Memory(Bytes),
}

/// The last agreed state: its step, the xxh3 of its bytes, its bytes.
pub(super) struct Agreed {
    pub(super) step: u64,
    digest: u64,
    kept: Kept,
}

impl Agreed {
    /// `state` kept as the agreed one: written to an unnamed file in `dir` as it is encoded; in
    /// memory where that fails. `digest`: the xxh3 of its encoding, when the comparison took it
    /// already (else it is taken on the way). An error only when it cannot be encoded.
    pub(super) fn keep(state: &TrainState, dir: &Path, digest: Option<u64>) -> Result<Agreed, StateError> {
        let step = state.position().global_step;
        let encoding = state.encoding()?;
        if let Ok(Some((file, hashed))) = tempfile::tempfile_in(dir).map(|f| write(&encoding, f, digest.is_none())) {
            return Ok(Agreed {
                step,
                digest: digest.or(hashed).expect("hashed unless given"),
                kept: Kept::File(file),
            });
        }
        let bytes = encoding.bytes()?;
        let digest = digest.unwrap_or_else(|| xxh3_64(&bytes));
        Ok(Agreed { step, digest, kept: Kept::Memory(bytes.into()) })
    }

    /// Whether it lies in a file rather than in memory.
    #[cfg(test)]
    pub(super) fn in_file(&self) -> bool {
        matches!(self.kept, Kept::File(_))
    }

    /// Its bytes, when they are still the ones kept (their xxh3 is the digest taken then).
    fn bytes(&self) -> Option<Bytes> {
        let bytes = match &self.kept {
            Kept::Memory(b) => b.clone(),
            Kept::File(file) => {
                let mut file = file.try_clone().ok()?;
                let mut out = Vec::new();
                file.seek(SeekFrom::Start(0)).ok()?;
                file.read_to_end(&mut out).ok()?;
                out.into()
            }
        };
        (xxh3_64(&bytes) == self.digest).then_some(bytes)
    }

    /// `state` put back to the agreed state, when its bytes are intact and taken: its step.
    pub(super) fn restore(&self, state: &mut TrainState) -> Option<u64> {
        let bytes = self.bytes()?;
        state.decode(bytes).ok().map(|()| self.step)
    }
}

/// `encoding`'s bytes written to `file`, and (when `hash`) their xxh3; `None` when a write failed.
fn write(encoding: &crate::state::replica::Encoding, file: File, hash: bool) -> Option<(File, Option<u64>)> {
    let (mut out, mut hasher, mut failed) = (BufWriter::with_capacity(BUFFER, file), hash.then(Xxh3::new), false);
    let written = encoding.write(&mut |b| {
        if let Some(h) = hasher.as_mut() {
            h.update(b);
        }
        failed = failed || out.write_all(b).is_err();
    });
    let file = out.into_inner().ok()?;
    (written.is_ok() && !failed).then(|| (file, hasher.map(|h| h.digest())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::optimizer::Optimizer;
    use crate::state::ModelState;
    use tch::{Device, Kind, Tensor};
    use trainerd_sdk::OptimizerConfig;

    /// A state told apart by `seed` (not from the random generator other tests share).
    fn state(seed: i64) -> TrainState {
        let w = Tensor::arange(64 * 32, (Kind::Float, Device::Cpu)).view([64, 32]) * (seed as f64);
        let params = vec![("w".to_string(), w)];
        let optimizer = Optimizer::new(OptimizerConfig::adam(1e-3), &params);
        TrainState::new(ModelState::new((params, Vec::new()), 1, Device::Cpu, true), optimizer)
    }

    #[test]
    fn the_agreed_state_lies_in_a_file_and_is_taken_back_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let agreed = Agreed::keep(&state(1), dir.path(), None).unwrap();
        assert!(agreed.in_file());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the file has no name");
        let mut other = state(2);
        assert_eq!(agreed.restore(&mut other), Some(0));
        assert_eq!(other.digest().unwrap(), state(1).digest().unwrap());
        // The digest the comparison took is the file's.
        let digest = xxh3_64(&state(1).encode().unwrap());
        let agreed = Agreed::keep(&state(1), dir.path(), Some(digest)).unwrap();
        assert_eq!((agreed.in_file(), agreed.digest), (true, digest));
        // A directory that cannot hold it: kept in memory, taken back the same.
        let agreed = Agreed::keep(&state(1), &dir.path().join("missing"), None).unwrap();
        assert!(!agreed.in_file());
        let mut other = state(3);
        assert_eq!(agreed.restore(&mut other), Some(0));
        assert_eq!(other.digest().unwrap(), state(1).digest().unwrap());
    }

    #[test]
    fn an_agreed_state_whose_bytes_changed_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let agreed = Agreed::keep(&state(1), dir.path(), None).unwrap();
        let Kept::File(file) = &agreed.kept else { panic!("in a file") };
        let mut f = file.try_clone().unwrap();
        f.seek(SeekFrom::Start(100)).unwrap();
        f.write_all(&[0xff; 4]).unwrap();
        let mut other = state(2);
        let before = other.digest().unwrap();
        assert_eq!(agreed.restore(&mut other), None);
        assert_eq!(other.digest().unwrap(), before, "nothing taken");
    }
}
