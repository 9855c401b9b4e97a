//! A member's word on its parts of a sharded commit, sent to the coordinator from the thread that
//! wrote them, and, on the coordinator's process, the words it has (docs/fault-tolerance.md,
//! "Sharded commits").

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::parts::Said;
use super::super::wire::proto;
use super::{ControlPlane, Dial, Shared};

/// What a thread other than the training thread needs to tell the coordinator about its parts.
#[derive(Clone)]
pub(crate) struct PartsReporter {
    runtime: tokio::runtime::Handle,
    dials: Arc<Vec<Dial>>,
    shared: Arc<Shared>,
    rank: usize,
}

impl PartsReporter {
    /// Tells the coordinator what this member's parts of commit `id` (planned in `generation`)
    /// came to, trying again until it answers, or the member is no longer in that generation
    /// (the commit was abandoned with it). Blocks: called by the thread that wrote the parts.
    pub(crate) fn say(&self, (generation, id): (u64, &str), said: Said) {
        let (entries_json, error) = match said {
            Ok(entries) => (entries, String::new()),
            Err(why) => (String::new(), why),
        };
        let request =
            proto::PartsRequest { generation, rank: self.rank as u32, data_id: id.to_string(), entries_json, error };
        while self.shared.generation.load(Ordering::SeqCst) == generation {
            if let Some((_, rank)) = self.shared.elections.coordinator() {
                let (dial, request) = (&self.dials[rank], request.clone());
                let sent = self.runtime.block_on(async {
                    let mut client = dial.connect(Instant::now() + Duration::from_secs(1)).await.ok()?;
                    tokio::time::timeout(Duration::from_secs(1), client.parts(request)).await.ok()?.ok()
                });
                if sent.is_some() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl ControlPlane {
    /// How a writing thread tells the coordinator what this member's parts came to.
    pub(crate) fn parts_reporter(&self) -> PartsReporter {
        PartsReporter {
            runtime: self.runtime.handle().clone(),
            dials: Arc::clone(&self.dials),
            shared: Arc::clone(&self.shared),
            rank: self.rank,
        }
    }

    /// On the coordinator's process: every member's word on its parts of commit `id` of
    /// `generation`, taken, once each of `ranks` has said.
    pub(crate) fn parts_said(&self, (generation, id): (u64, &str), ranks: &[usize]) -> Option<BTreeMap<usize, Said>> {
        self.parts.take_when_all((generation, id), ranks)
    }
}
