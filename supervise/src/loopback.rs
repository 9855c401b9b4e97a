//! A cluster on one host: free loopback ports, and each worker's TF_CONFIG on them (what `trainerd
//! local` and the tests start).
//!
//! The ports are chosen between 10000 and 20000, below Linux's ephemeral range (32768 and up by
//! default): a worker's data-plane listener, which binds port 0, is given an ephemeral port, so it
//! can never take the control port of a worker that has not started yet. Ports picked by the kernel
//! for `127.0.0.1:0` and released could be handed out again that way.

use std::hash::BuildHasher;
use std::net::TcpListener;
use std::sync::Mutex;

/// Where ports are chosen: `[FIRST, END)`.
const FIRST: u16 = 10_000;
const END: u16 = 20_000;

/// Where the last pick of this process stopped: successive picks (tests in threads of one
/// process) never hand out the same port twice before going round the whole range.
static NEXT: Mutex<Option<u16>> = Mutex::new(None);

/// `n` free loopback ports below the ephemeral range, bound together while chosen (so they differ)
/// and then released for the daemons to bind.
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let mut next = NEXT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // A process starts at a random place, so that processes choosing at once rarely meet.
    let span = u64::from(END - FIRST);
    let mut candidate =
        next.unwrap_or_else(|| FIRST + (std::hash::RandomState::new().hash_one(std::process::id()) % span) as u16);
    let mut held = Vec::with_capacity(n);
    for _ in 0..span {
        if held.len() == n {
            break;
        }
        candidate = if candidate + 1 >= END { FIRST } else { candidate + 1 };
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", candidate)) {
            held.push(listener);
        }
    }
    *next = Some(candidate);
    if held.len() < n {
        return Err(std::io::Error::other(format!("fewer than {n} free loopback ports between {FIRST} and {END}")));
    }
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// The TF_CONFIG of worker `index` in a cluster of workers on loopback `ports`.
pub fn tf_config(ports: &[u16], index: usize) -> String {
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": index}}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_differ_lie_below_the_ephemeral_range_and_each_worker_has_its_index() {
        let ports = free_ports(3).unwrap();
        assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2]);
        assert!(ports.iter().all(|p| (FIRST..END).contains(p)), "{ports:?}");
        let more = free_ports(3).unwrap();
        assert!(more.iter().all(|p| !ports.contains(p)), "a later pick in one process starts after the last");
        let config: serde_json::Value = serde_json::from_str(&tf_config(&[1, 2], 1)).unwrap();
        assert_eq!(config["cluster"]["worker"], serde_json::json!(["127.0.0.1:1", "127.0.0.1:2"]));
        assert_eq!(config["task"], serde_json::json!({"type": "worker", "index": 1}));
    }
}
