//! Free loopback ports for the servers and daemons a test starts, and TF_CONFIG on them.

pub use trainerd_supervise::loopback::tf_config;

/// `n` free loopback ports (held together while chosen, so they differ).
pub fn free_ports(n: usize) -> Vec<u16> {
    trainerd_supervise::loopback::free_ports(n).expect("free loopback ports")
}

/// `n` ports below 55000, each free together with its +10000 twin.
///
/// Nothing holds them until weed binds them, so two servers starting at once must not scan the
/// same ports: the scan starts at a random place (another process, a test's child among them,
/// starts elsewhere) and goes on, in this process, from where the last one stopped.
pub(crate) fn free_port_pairs(n: usize) -> Result<Vec<u16>, String> {
    use std::net::TcpListener;
    static NEXT: std::sync::Mutex<Option<u16>> = std::sync::Mutex::new(None);
    let mut next = NEXT.lock().expect("not poisoned");
    let mut held = Vec::new();
    let mut ports = Vec::new();
    let mut candidate = next.unwrap_or_else(|| 20000 + (uuid::Uuid::new_v4().as_u128() % 25000) as u16);
    for _ in 0..25000 {
        if ports.len() == n {
            break;
        }
        candidate = if candidate >= 44999 { 20000 } else { candidate + 1 };
        if let (Ok(a), Ok(b)) =
            (TcpListener::bind(("127.0.0.1", candidate)), TcpListener::bind(("127.0.0.1", candidate + 10000)))
        {
            held.push((a, b));
            ports.push(candidate);
        }
    }
    *next = Some(candidate);
    if ports.len() < n {
        return Err("no free ports for weed".into());
    }
    Ok(ports)
}
