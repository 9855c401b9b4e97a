//! Free loopback ports for the servers and daemons a test starts, and TF_CONFIG on them.

pub use trainerd_supervise::loopback::tf_config;

/// `n` free loopback ports (held together while chosen, so they differ).
pub fn free_ports(n: usize) -> Vec<u16> {
    trainerd_supervise::loopback::free_ports(n).expect("free loopback ports")
}

/// `n` ports, each free together with its +10000 twin, all below the kernel's ephemeral range.
///
/// Nothing holds them until weed binds them. Below the ephemeral range (`ip_local_port_range`,
/// 32768 and up by default) no outgoing connection takes one meanwhile: a CI run's daemons and
/// clients open thousands, and weed, finding one of its ports taken, exits (status 255) or
/// leaves a part unstarted. Two servers starting at once must not scan the same ports either:
/// the scan starts at a random place (another process, a test's child among them, starts
/// elsewhere) and goes on, in this process, from where the last one stopped.
pub(crate) fn free_port_pairs(n: usize) -> Result<Vec<u16>, String> {
    use std::net::TcpListener;
    static NEXT: std::sync::Mutex<Option<u16>> = std::sync::Mutex::new(None);
    let (low, high) = pair_range()?;
    let span = high - low;
    let mut next = NEXT.lock().expect("not poisoned");
    let mut held = Vec::new();
    let mut ports = Vec::new();
    let mut candidate = next.unwrap_or_else(|| low + (uuid::Uuid::new_v4().as_u128() % u128::from(span)) as u16);
    for _ in 0..span {
        if ports.len() == n {
            break;
        }
        candidate = if candidate + 1 >= high { low } else { candidate + 1 };
        if let (Ok(a), Ok(b)) =
            (TcpListener::bind(("127.0.0.1", candidate)), TcpListener::bind(("127.0.0.1", candidate + 10000)))
        {
            held.push((a, b));
            ports.push(candidate);
        }
    }
    *next = Some(candidate);
    if ports.len() < n {
        return Err(format!("no {n} free port pairs for weed in {low}-{high} (and +10000)"));
    }
    Ok(ports)
}

/// The ports a pair may start at: from 20000 (clusters take 10000-19999, `free_ports`) up to where
/// the twin would reach the ephemeral range (22768 by default: 2768 pairs, 9 per server).
fn pair_range() -> Result<(u16, u16), String> {
    const RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = std::fs::read_to_string(RANGE).unwrap_or_else(|_| "32768 60999".into());
    let ephemeral: u16 = text
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| format!("{RANGE}: expected two port numbers, found {text:?}"))?;
    let high = ephemeral.saturating_sub(10000);
    if high < 20000 + 100 {
        return Err(format!("{RANGE} starts at {ephemeral}: too low for weed's ports and their +10000 twins"));
    }
    Ok((20000, high))
}

#[cfg(test)]
mod tests {
    /// No port weed is given, nor its gRPC twin, is one an outgoing connection can take, nor one
    /// a cluster's workers are given.
    #[test]
    fn weeds_ports_and_their_twins_stay_between_the_clusters_and_the_ephemeral_range() {
        let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let ephemeral: u16 = text.split_whitespace().next().unwrap().parse().unwrap();
        let ports = super::free_port_pairs(9).unwrap();
        assert_eq!(ports.len(), 9);
        for p in ports {
            assert!((20000..ephemeral - 10000).contains(&p), "{p} (ephemeral ports from {ephemeral})");
        }
    }
}
