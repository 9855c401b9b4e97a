//! Collectives among the workers of a run: the abortable ring data plane ([`ring`]) on a
//! persistent listener ([`ring::listener`]), its abort switch ([`abort`]), and gradient averaging
//! over fused buckets ([`buckets`]). It knows nothing of training or plugins.

pub mod abort;
pub mod buckets;
pub mod nccl;
pub mod ring;
pub mod slots;

pub use abort::AbortSignal;
pub use ring::listener::DataListener;
pub use ring::{CollectiveError, ReduceOp, Ring};
pub use slots::Slots;

use std::sync::atomic::{AtomicU64, Ordering};

static SENT_BYTES: AtomicU64 = AtomicU64::new(0);
static BUSY_NANOS: AtomicU64 = AtomicU64::new(0);

/// Bytes this process sent in all-reduces, and seconds it spent in them, since it started.
pub fn traffic() -> (u64, f64) {
    (SENT_BYTES.load(Ordering::Relaxed), BUSY_NANOS.load(Ordering::Relaxed) as f64 / 1e9)
}

fn count_traffic(bytes: u64, took: std::time::Duration) {
    SENT_BYTES.fetch_add(bytes, Ordering::Relaxed);
    BUSY_NANOS.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
}

/// What carries the gradients' all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The host-staged TCP ring ([`ring`]).
    Ring,
    /// NCCL on the device ([`nccl`]), with this NCCL version code.
    Nccl(i32),
}

impl Backend {
    /// How it enters the run configuration every worker must agree on (`None` for the ring, so
    /// that the configuration of ring runs, and of their checkpoints, stays as it was).
    pub fn agreement(self) -> Option<String> {
        match self {
            Backend::Ring => None,
            Backend::Nccl(v) => Some(format!("nccl {} (send/recv, ring-order sums)", nccl::version_text(v))),
        }
    }

    /// For the start-up line.
    pub fn describe(self) -> String {
        match self {
            Backend::Ring => "host-staged ring".into(),
            Backend::Nccl(v) => format!("NCCL {} (ring-order sums on the device)", nccl::version_text(v)),
        }
    }
}

/// The backend `--collective CHOICE` gives a worker training on `device`, with `sharing` other
/// workers of its cluster on its host and `gpus` GPUs visible; with `auto`, also why not NCCL.
/// `auto` is NCCL only when it can run here and no two workers can land on one GPU (NCCL refuses
/// two ranks on one GPU unless each has its own `NCCL_HOSTID`).
pub fn choose(
    choice: &str,
    device: tch::Device,
    (sharing, gpus): (usize, usize),
) -> Result<(Backend, Option<String>), String> {
    match choice {
        "ring" => Ok((Backend::Ring, None)),
        "nccl" => nccl::usable_on(device).map(|n| (Backend::Nccl(n.version()), None)),
        "auto" => {
            let nccl = match nccl::usable_on(device) {
                Ok(n) => n,
                Err(why) => return Ok((Backend::Ring, Some(why.replace("--collective nccl", "NCCL")))),
            };
            let hostid = std::env::var_os("NCCL_HOSTID").is_some();
            if hostid || sharing < gpus {
                Ok((Backend::Nccl(nccl.version()), None))
            } else {
                Ok((
                    Backend::Ring,
                    Some(format!(
                        "{} workers share this host's {gpus} GPU(s) and NCCL refuses two ranks on one GPU (set NCCL_HOSTID \
                         per worker to use it anyway)",
                        sharing + 1
                    )),
                ))
            }
        }
        other => Err(format!("--collective {other}: expected ring, nccl or auto")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn the_backend_follows_the_flag_and_auto_says_why_not_nccl() {
        assert_eq!(choose("ring", Device::Cpu, (0, 0)), Ok((Backend::Ring, None)));
        assert_eq!(
            choose("nccl", Device::Cpu, (0, 0)).unwrap_err(),
            "--collective nccl needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu"
        );
        assert_eq!(
            choose("auto", Device::Cpu, (1, 0)),
            Ok((
                Backend::Ring,
                Some("NCCL needs CUDA: NCCL moves CUDA tensors only, and this worker trains on cpu".into())
            ))
        );
        assert_eq!(choose("gloo", Device::Cpu, (0, 0)).unwrap_err(), "--collective gloo: expected ring, nccl or auto");
        assert_eq!(Backend::Ring.agreement(), None, "ring runs keep their run configuration");
        assert_eq!(Backend::Nccl(22809).agreement().as_deref(), Some("nccl 2.28.9 (send/recv, ring-order sums)"));
    }
}
