//! A switch of network namespaces that a test makes, as root, to partition its workers for real:
//! each worker runs in a namespace of its own (`10.213.0.(i+1)`), wired to one bridge in a switch
//! namespace; cutting a worker takes its port on the bridge down, so its packets are dropped (no
//! reset: its peers see silence, as in a real partition), and healing brings the port back. The
//! namespaces are deleted when it is dropped. No traffic leaves the namespaces the test made.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static MADE: AtomicUsize = AtomicUsize::new(0);

/// A switch and one namespace per worker.
pub struct Netns {
    switch: String,
    workers: Vec<String>,
}

fn ip(args: &[&str]) -> std::io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

impl Netns {
    /// Makes the switch and `n` worker namespaces (needs root and `ip`).
    pub fn create(n: usize) -> std::io::Result<Netns> {
        let tag = format!("td{}x{}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
        let net = Netns { switch: format!("{tag}s"), workers: (0..n).map(|i| format!("{tag}w{i}")).collect() };
        ip(&["netns", "add", &net.switch])?;
        ip(&["-n", &net.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &net.switch, "link", "set", "br0", "up"])?;
        for (i, ns) in net.workers.iter().enumerate() {
            let port = format!("p{i}");
            let addr = format!("{}/24", net.host(i));
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &net.switch])?;
            ip(&["-n", &net.switch, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Worker `i`'s address.
    pub fn host(&self, i: usize) -> String {
        format!("10.213.0.{}", i + 1)
    }

    /// The command prefix that runs a program in worker `i`'s namespace.
    pub fn exec(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", &self.workers[i]].map(String::from).to_vec()
    }

    /// Cuts worker `i` off from every other (its packets are dropped).
    pub fn cut(&self, i: usize) {
        ip(&["-n", &self.switch, "link", "set", &format!("p{i}"), "down"]).expect("cut a link");
    }

    /// Connects worker `i` again.
    pub fn heal(&self, i: usize) {
        ip(&["-n", &self.switch, "link", "set", &format!("p{i}"), "up"]).expect("heal a link");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in self.workers.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
