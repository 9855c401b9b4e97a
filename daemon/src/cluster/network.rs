//! Where a member listens and whether its peers must authenticate: a cluster whose every address
//! is loopback may run without a secret (`trainerd local`, tests); any other needs one, or an
//! explicit `--insecure`. By default a member of a cluster across hosts listens on every
//! interface (its TF_CONFIG host may resolve to 127.0.1.1, as Debian maps its own name, or not
//! resolve at all before a Kubernetes service's record exists), and a loopback cluster on its
//! resolved loopback address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};

use super::tf_config::ClusterConfig;
use crate::auth::ClusterKey;

/// How a member meets the network.
#[derive(Clone, Debug)]
pub(crate) struct Network {
    /// The address its control plane and data listener bind.
    pub(crate) bind: IpAddr,
    /// The cluster secret every connection proves, if any.
    pub(crate) key: Option<ClusterKey>,
}

/// A cluster across hosts without a secret, and without `--insecure`.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error(
    "TF_CONFIG puts {} {} at {}, which is not a loopback address: a cluster across hosts needs a shared secret so \
     that nobody else on the network can join it or read it. Give every worker the same --secret-file \
     (TRAINERD_SECRET_FILE), or pass --insecure to run without one",
    member.job, member.index, member.address
)]
pub(crate) struct Unguarded {
    /// The first member outside this host.
    pub(crate) member: super::Member,
}

impl Network {
    /// Loopback, no secret: a cluster on one host (tests, and `Network` for a lone worker).
    pub(crate) fn loopback() -> Network {
        Network { bind: IpAddr::V4(Ipv4Addr::LOCALHOST), key: None }
    }

    /// The settings for `cluster`: `listen` overrides the bind address; without `key`, a
    /// cluster with any non-loopback address is refused unless `insecure`.
    pub(crate) fn plan(
        cluster: &ClusterConfig,
        listen: Option<IpAddr>,
        key: Option<ClusterKey>,
        insecure: bool,
    ) -> Result<Network, Unguarded> {
        let outside = cluster.members.iter().find(|m| !is_loopback(&m.address));
        if let (Some(m), None, false) = (outside, &key, insecure) {
            return Err(Unguarded { member: m.clone() });
        }
        let own = resolve_all(&cluster.me().address).into_iter().next();
        let bind = listen.unwrap_or(match (outside, own) {
            (None, Some(ip)) => ip,
            (_, Some(IpAddr::V6(_))) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        });
        Ok(Network { bind, key })
    }
}

fn resolve_all(address: &str) -> Vec<IpAddr> {
    address.to_socket_addrs().map(|a| a.map(|s| s.ip()).collect()).unwrap_or_default()
}

/// Whether `host:port` resolves, and only to loopback addresses.
fn is_loopback(address: &str) -> bool {
    let ips = resolve_all(address);
    !ips.is_empty() && ips.iter().all(IpAddr::is_loopback)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tf_config;

    fn cluster(addrs: &[&str]) -> ClusterConfig {
        let text = serde_json::json!({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": 0}});
        tf_config::parse(&text.to_string(), "TF_CONFIG").unwrap().unwrap()
    }

    #[test]
    fn loopback_clusters_need_no_secret_and_bind_loopback() {
        let net = Network::plan(&cluster(&["127.0.0.1:2222", "localhost:2223"]), None, None, false).unwrap();
        assert_eq!(net.bind, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(net.key.is_none());
    }

    #[test]
    fn clusters_across_hosts_need_a_secret_or_insecure_and_bind_every_interface() {
        let c = cluster(&["127.0.0.1:2222", "192.0.2.7:2222"]);
        assert_eq!(
            Network::plan(&c, None, None, false).unwrap_err().to_string(),
            "TF_CONFIG puts worker 1 at 192.0.2.7:2222, which is not a loopback address: a cluster across hosts needs \
             a shared secret so that nobody else on the network can join it or read it. Give every worker the same \
             --secret-file (TRAINERD_SECRET_FILE), or pass --insecure to run without one"
        );
        let key = ClusterKey::from_bytes(b"0123456789abcdef0");
        assert_eq!(Network::plan(&c, None, Some(key.clone()), false).unwrap().bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(Network::plan(&c, None, None, true).unwrap().bind, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        // A name that does not resolve yet (a Kubernetes service before its record exists).
        let k8s = cluster(&["job-worker-0.trainerd.invalid:2222", "job-worker-1.trainerd.invalid:2222"]);
        assert!(Network::plan(&k8s, None, None, false).is_err());
        assert_eq!(
            Network::plan(&k8s, None, Some(key.clone()), false).unwrap().bind,
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        );
        // --listen decides.
        let listen: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(Network::plan(&c, Some(listen), Some(key), false).unwrap().bind, listen);
    }
}
