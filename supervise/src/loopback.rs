//! A cluster on one host: free loopback ports, and each worker's TF_CONFIG on them (what `trainerd
//! local` and the tests start).

/// `n` free loopback ports, bound together while chosen so that they differ, then released
/// (another process could take one in between, which the daemon then reports as a port in use).
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let listeners: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
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
    fn ports_differ_and_each_worker_has_its_index() {
        let ports = free_ports(3).unwrap();
        assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2]);
        let config: serde_json::Value = serde_json::from_str(&tf_config(&[1, 2], 1)).unwrap();
        assert_eq!(config["cluster"]["worker"], serde_json::json!(["127.0.0.1:1", "127.0.0.1:2"]));
        assert_eq!(config["task"], serde_json::json!({"type": "worker", "index": 1}));
    }
}
