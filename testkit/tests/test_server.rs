//! The S3-compatible test server never outlives the test process that started it, even when
//! that process ends without dropping anything (a server in a `static`, an abort, a SIGKILL); a
//! cut link to it fails every request until it is restored.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use trainerd_testkit::s3::S3Server;

const HELPER: &str = "TRAINERD_TEST_SERVER_HELPER";

/// Run by the test below in a process of its own: starts a server and aborts.
#[test]
#[ignore = "a helper: a_test_process_that_dies_takes_its_server_with_it runs it"]
fn helper_starts_a_server_then_aborts() {
    if std::env::var_os(HELPER).is_none() {
        return;
    }
    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    println!("server pid {}", server.pid());
    std::io::stdout().flush().unwrap();
    std::process::abort();
}

/// Whether `pid` is a live process (a zombie waiting for a reaper is not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => !matches!(stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()), Some('Z' | 'X')),
        Err(_) => false,
    }
}

#[test]
fn a_test_process_that_dies_takes_its_server_with_it() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "helper_starts_a_server_then_aborts", "--ignored", "--nocapture", "--test-threads=1"])
        .env(HELPER, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.split_once("server pid ").map(|(_, pid)| pid.trim()))
        .unwrap_or_else(|| panic!("the helper started no server:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr)))
        .parse()
        .unwrap();
    assert!(!out.status.success(), "the helper aborts");
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        if Instant::now() > deadline {
            // SAFETY: kill(2); do not leave it behind either way.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("the S3-compatible server (pid {pid}) outlived the test process that started it");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_cut_link_fails_requests_open_and_new_until_it_is_restored() {
    let server = S3Server::start().unwrap_or_else(|e| panic!("S3-compatible test server: {e}"));
    let link = server.link().unwrap();
    let store = server.store_via(&link.endpoint()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let put = |name: &str| rt.block_on(store.put(&Path::from(name), PutPayload::from_static(b"bytes")));
    // Through the link, with a pooled connection left open.
    put("a").unwrap();
    link.cut();
    let err = put("b").unwrap_err();
    assert!(matches!(err, object_store::Error::Generic { .. }), "{err}");
    put("c").unwrap_err();
    link.restore();
    put("d").unwrap();
    // What went through reached the server; what was cut did not.
    let direct = server.store().unwrap();
    for (name, there) in [("a", true), ("b", false), ("c", false), ("d", true)] {
        assert_eq!(rt.block_on(direct.head(&Path::from(name))).is_ok(), there, "{name}");
    }
}
