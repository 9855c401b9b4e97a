use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::dial::Dial;
use super::{ControlPlane, Settings};
use crate::auth::ClusterKey;
use crate::cluster::coordinator::rules::Report;
use crate::cluster::network::Network;
use crate::cluster::tf_config::{self, ClusterConfig};
use crate::cluster::timeouts::Timeouts;
use crate::cluster::wire::{proto, Formed, Identity};

fn ports(n: usize) -> Vec<u16> {
    trainerd_supervise::loopback::free_ports(n).unwrap()
}

fn cluster(ports: &[u16], rank: usize) -> ClusterConfig {
    tf_config::parse(&trainerd_supervise::loopback::tf_config(ports, rank), "TF_CONFIG").unwrap().unwrap()
}

fn identity(c: &ClusterConfig, run: &str) -> Identity {
    Identity { cluster_json: c.cluster_json(), plugin: "p 1".into(), run_config_json: run.into() }
}

const FAST: Timeouts = Timeouts {
    rendezvous: Duration::from_secs(20),
    heartbeat_interval: Duration::from_millis(50),
    heartbeat_deadline: Duration::from_millis(500),
    collective: Duration::from_secs(5),
    rejoin: Duration::from_secs(20),
    replace_after: Duration::from_secs(10),
    data: Duration::from_secs(2),
    min_workers: None,
};

fn plane(ports: &[u16], rank: usize, t: Timeouts) -> ControlPlane {
    let c = cluster(ports, rank);
    ControlPlane::start(
        &c,
        identity(&c, "{}"),
        Settings { timeouts: t, network: &Network::loopback(), state_dir: None },
    )
    .unwrap()
}

fn report(generation: u64, step: u64, digest: &str) -> Report {
    Report { generation, progress: (step, 0), digest: digest.into(), reached: step, ..Report::default() }
}

/// Every plane joins with its report, in threads; the formations, by rank.
fn join_all(planes: &mut [ControlPlane], reports: &[Report]) -> Vec<Formed> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let handles: Vec<_> = planes
            .iter_mut()
            .zip(reports)
            .map(|(p, r)| {
                let stop = &stop;
                s.spawn(move || p.join(&format!("127.0.0.1:{}", 1000 + p.rank()), r, stop).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Waits until `generation` is aborted on `plane`; its reason.
fn aborted(plane: &ControlPlane, generation: u64, within: Duration) -> String {
    let until = Instant::now() + within;
    loop {
        if let Err(aborted) = plane.abort_signal().check(generation) {
            return aborted.reason;
        }
        assert!(Instant::now() < until, "generation {generation} was not aborted within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_crashed_member_ends_the_generation_and_its_successor_gets_the_furthest_state() {
    let ports = ports(3);
    let mut planes: Vec<ControlPlane> = (0..3).map(|r| plane(&ports, r, FAST)).collect();
    let first = join_all(&mut planes, &[report(0, 0, "init"), Report::default(), Report::default()]);
    for f in &first {
        assert_eq!((f.generation, f.source, f.receivers.clone(), f.recovery), (1, 0, vec![1, 2], false));
        assert_eq!(f.data_addresses, ["127.0.0.1:1000", "127.0.0.1:1001", "127.0.0.1:1002"]);
    }
    // Worker 2 crashes: its heartbeat stream closes, and the chief ends generation 1 for everyone.
    drop(planes.pop());
    for p in &planes {
        let why = aborted(p, 1, Duration::from_secs(5));
        assert!(why.contains("worker 2") && why.contains("lost its connection to the chief"), "{why}");
    }
    // Its restarted process joins with nothing; worker 1 finished step 6, worker 0 only step 5.
    planes.push(plane(&ports, 2, FAST));
    let second = join_all(&mut planes, &[report(1, 5, "s5"), report(1, 6, "s6"), Report::default()]);
    for f in &second {
        assert_eq!((f.generation, f.source, f.progress), (3, 1, (6, 0)));
        assert_eq!((f.receivers.clone(), f.recovery, f.steps_lost), (vec![0, 2], true, 0));
    }
}

/// A plane that keeps its vote in `dir`.
fn voting(ports: &[u16], rank: usize, t: Timeouts, dir: &std::path::Path) -> ControlPlane {
    let c = cluster(ports, rank);
    ControlPlane::start(
        &c,
        identity(&c, "{}"),
        Settings { timeouts: t, network: &Network::loopback(), state_dir: Some(dir) },
    )
    .unwrap()
}

/// Every plane joins, again until a generation holds all of them: rank 0 holding nothing, the
/// others `theirs`.
fn join_until_whole(planes: &mut [ControlPlane], theirs: &Report) -> Vec<Formed> {
    let (stop, world) = (AtomicBool::new(false), planes.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = planes
            .iter_mut()
            .map(|p| {
                let (stop, r) = (&stop, if p.rank() == 0 { Report::default() } else { theirs.clone() });
                s.spawn(move || loop {
                    let f = p.join("127.0.0.1:1", &r, stop).unwrap();
                    if f.members.len() == world {
                        return f;
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_chief_lost_for_good_is_replaced_by_an_elected_coordinator_and_rejoins_as_a_member() {
    let ports = ports(3);
    let dir = tempfile::tempdir().unwrap();
    let t = Timeouts { replace_after: Duration::from_secs(1), ..FAST };
    let mut planes: Vec<ControlPlane> = (0..3).map(|r| voting(&ports, r, t, dir.path())).collect();
    let first = join_all(&mut planes, &[report(0, 0, "init"), Report::default(), Report::default()]);
    assert_eq!((first[0].coordinator, first[0].term), (0, 0));
    // Fresh vote directories: each member votes once a majority of the others told it the term.
    let until = Instant::now() + Duration::from_secs(5);
    while planes.iter().any(|p| p.shared.elections.forgetful()) {
        assert!(Instant::now() < until, "the members never heard the term from a majority");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The chief dies and does not come back.
    let chief = planes.remove(0);
    drop(chief);
    let started = Instant::now();
    let second = join_all(&mut planes, &[report(1, 5, "s5"), report(1, 5, "s5")]);
    let took = started.elapsed();
    // Worker 1 stands first; on a loaded machine its term can lose to late votes, and worker 2
    // wins the next one. Either survivor may coordinate, but both follow the same one.
    let elected = second[0].coordinator;
    assert!(elected == 1 || elected == 2, "{:?}", second[0]);
    for f in &second {
        assert_eq!((f.coordinator, f.members.clone()), (elected, vec![1, 2]), "{f:?}");
        assert!(f.term > first[0].generation && f.generation > f.term, "{f:?}");
    }
    assert!(took >= Duration::from_secs(1), "elected before --replace-after: {took:?}");
    assert!(took < Duration::from_secs(6), "the election took {took:?}");
    let (winner, voter) = if elected == 1 { (0, 1) } else { (1, 0) };
    assert_eq!(planes[winner].coordinates(), Some(second[0].term));
    assert_eq!(planes[voter].coordinates(), None);
    // The votes are kept: the other survivor voted for the winner in that term, and follows it.
    let files = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap());
    let votes = files.filter(|name| name.starts_with("vote-")).count();
    assert_eq!(votes, 3, "every member keeps its vote");
    let vote = planes[voter].shared.elections.vote();
    assert_eq!((vote.term, vote.voted_for, vote.coordinator), (second[0].term, Some(elected), Some(elected)));
    // The chief comes back: it finds the new coordinator, joins as a member, takes its slot back.
    // (Workers 1 and 2 join again until a generation holds it, as the training loop does.)
    planes.insert(0, voting(&ports, 0, t, dir.path()));
    let third = join_until_whole(&mut planes, &report(second[0].generation, 9, "s9"));
    for f in &third {
        assert_eq!((f.coordinator, f.term, f.members.clone()), (elected, second[0].term, vec![0, 1, 2]), "{f:?}");
        assert_eq!((f.source, f.receivers.clone()), (1, vec![0]));
    }
    assert_eq!(planes[0].coordinates(), None, "the old chief coordinates no more");
}

#[test]
fn a_silent_member_is_failed_at_the_heartbeat_deadline_and_barriers_abort() {
    let ports = ports(2);
    // Worker 1 beats once, then stays silent as a frozen process would.
    let silent =
        Timeouts { heartbeat_interval: Duration::from_secs(60), heartbeat_deadline: Duration::from_secs(120), ..FAST };
    let mut planes = vec![plane(&ports, 0, FAST), plane(&ports, 1, silent)];
    let formed = join_all(&mut planes, &[report(0, 0, "init"), Report::default()]);
    let generation = formed[0].generation;
    let started = Instant::now();
    let err = planes[0].barrier(generation, "never").unwrap_err().to_string();
    let took = started.elapsed();
    assert!(
        err.starts_with(&format!(
            "generation {generation} ended: worker 1 (127.0.0.1:{}) sent no heartbeat for ",
            ports[1]
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "the barrier waited {took:?}");
    let why = aborted(&planes[0], generation, Duration::from_secs(1));
    assert!(why.contains("sent no heartbeat for"), "{why}");
}

#[test]
fn after_a_give_up_every_member_gets_its_reason_before_the_chief_exits_and_late_ones_at_once() {
    let ports = ports(3);
    // Every member is needed (a majority would start short without worker 2).
    let t = Timeouts { rendezvous: Duration::from_secs(2), min_workers: Some(3), ..FAST };
    let mut planes = [plane(&ports, 0, t), plane(&ports, 1, FAST)];
    let stop = AtomicBool::new(false);
    let errors: Vec<String> = std::thread::scope(|s| {
        let joins: Vec<_> = planes
            .iter_mut()
            .map(|p| {
                let stop = &stop;
                s.spawn(move || p.join("127.0.0.1:1", &Report::default(), stop).unwrap_err().to_string())
            })
            .collect();
        joins.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected = format!("rendezvous: worker 2 (127.0.0.1:{}) did not join within 2s", ports[2]);
    assert_eq!(errors, [expected.clone(), expected.clone()]);
    let coordinator = planes[0].seated().unwrap();
    assert!(coordinator.answered(), "the chief's join returned before worker 1 had its answer");
    // Worker 2 comes after the give-up, while the chief is on its way out: it is told at once,
    // not after another rendezvous timeout.
    let mut late = plane(&ports, 2, FAST);
    let started = Instant::now();
    let err = late.join("127.0.0.1:1", &Report::default(), &stop).unwrap_err().to_string();
    assert_eq!(err, expected);
    assert!(started.elapsed() < Duration::from_millis(1500), "the late join waited {:?}", started.elapsed());
    assert!(coordinator.answered(), "worker 2 said it got the answer");
}

#[test]
fn a_generation_holds_a_bounded_number_of_barriers() {
    let ports = ports(2);
    let mut planes = vec![plane(&ports, 0, FAST), plane(&ports, 1, FAST)];
    let generation = join_all(&mut planes, &[report(0, 0, "init"), Report::default()])[0].generation;
    let worker = Arc::new(planes.pop().unwrap());
    // 17 barriers the chief never reaches: 16 stay open, one is refused at once.
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..17 {
        let (w, tx) = (Arc::clone(&worker), tx.clone());
        std::thread::spawn(move || tx.send(w.barrier(generation, &format!("b{i:02}"))));
    }
    let refused = rx.recv_timeout(Duration::from_secs(10)).expect("one barrier is refused").unwrap_err();
    let text = refused.to_string();
    assert!(
        text.starts_with("control plane: barrier b") && text.ends_with(": a generation has at most 16 barriers"),
        "{text}"
    );
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "the other 16 stay open");
    let long = "x".repeat(65);
    let err = worker.barrier(generation, &long).unwrap_err().to_string();
    assert_eq!(err, format!("control plane: barrier {long}: barrier names are at most 64 bytes"));
}

#[test]
fn a_different_run_configuration_is_refused_with_both_values() {
    let ports = ports(2);
    let c0 = cluster(&ports, 0);
    let _chief = ControlPlane::start(
        &c0,
        identity(&c0, r#"{"batch_size":64,"seed":0}"#),
        Settings { timeouts: FAST, network: &Network::loopback(), state_dir: None },
    )
    .unwrap();
    let c1 = cluster(&ports, 1);
    let mut worker = ControlPlane::start(
        &c1,
        identity(&c1, r#"{"batch_size":32,"seed":0}"#),
        Settings { timeouts: FAST, network: &Network::loopback(), state_dir: None },
    )
    .unwrap();
    let err = worker.join("127.0.0.1:1", &Report::default(), &AtomicBool::new(false)).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "rendezvous refused by the chief: worker 1 (127.0.0.1:{}) has a different run configuration: \
             batch_size = 32 on worker 1 (127.0.0.1:{}), 64 on the chief, worker 0 (127.0.0.1:{})",
            ports[1], ports[1], ports[0]
        )
    );
}

#[test]
fn a_port_in_use_is_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let c = cluster(&[port, ports(1)[0]], 0);
    let err = ControlPlane::start(
        &c,
        identity(&c, "{}"),
        Settings { timeouts: FAST, network: &Network::loopback(), state_dir: None },
    )
    .err()
    .unwrap()
    .to_string();
    assert_eq!(
        err,
        format!(
            "cannot listen on 127.0.0.1:{port} (worker 0 (127.0.0.1:{port})'s address in TF_CONFIG): Address \
             already in use (os error 98)"
        )
    );
}

#[test]
fn with_a_secret_only_members_that_know_it_are_served() {
    let ports = ports(2);
    let key = |k: &[u8]| Network { key: Some(ClusterKey::from_bytes(k)), ..Network::loopback() };
    let secret = b"a-cluster-secret-0123456789";
    let start = |rank| {
        let c = cluster(&ports, rank);
        ControlPlane::start(&c, identity(&c, "{}"), Settings { timeouts: FAST, network: &key(secret), state_dir: None })
            .unwrap()
    };
    let mut planes = vec![start(0), start(1)];
    let formed = join_all(&mut planes, &[report(0, 0, ""), report(0, 0, "")]);
    assert_eq!(formed[0].generation, formed[1].generation);
    let chief = format!("127.0.0.1:{}", ports[0]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let soon = || Instant::now() + Duration::from_millis(500);
    // Another secret, and none at all: no call gets through.
    let err =
        runtime.block_on(Dial::new(&chief, &key(b"another-secret-0123456789").key).connect(soon())).err().unwrap();
    let err = err.to_string();
    assert!(err.ends_with("the cluster secrets differ (is the same --secret-file set on every worker?)"), "{err}");
    let bare = runtime.block_on(async {
        let mut client = Dial::new(&chief, &None).connect(soon()).await.ok()?;
        let request = proto::LeaveRequest { rank: 1, incarnation: 0, reason: "x".into() };
        Some(tokio::time::timeout(Duration::from_secs(5), client.leave(request)).await)
    });
    match bare {
        None | Some(Err(_)) => {} // no connection, or no answer
        Some(Ok(Ok(_))) => panic!("a client without the secret was served"),
        Some(Ok(Err(status))) => {
            let text = status.message();
            assert!(!text.contains("worker") && !text.contains("127.0.0.1"), "the refusal names nothing: {text}");
        }
    }
}
