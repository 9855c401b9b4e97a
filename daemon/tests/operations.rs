//! What an operator relies on, through the real binary: systemd's notifications and watchdog
//! (a NOTIFY_SOCKET the test owns), Prometheus metrics (scraped during training and parsed by
//! the `prometheus_client` Python package's OpenMetrics parser), authenticated ports, refused
//! files, and log lines without escape codes.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use trainerd_testkit::notify::NotifySocket;
use trainerd_testkit::output::{error_line, error_of, text};
use trainerd_testkit::{dataset, free_ports, plugin, tf_config, trainerd_cmd, RunArgs};

/// A `trainerd run` of the fixture plugin: `steps` steps per epoch, one thread.
fn fixture(steps: u64, epochs: u32) -> RunArgs {
    RunArgs::new("test-fixture").threads(1).steps(steps).epochs(epochs)
}

/// `trainerd run` of `run`, in an environment without a cluster or systemd of the test's.
fn run_cmd(run: RunArgs) -> Command {
    let mut cmd = run.command("run");
    cmd.env_remove("TF_CONFIG").env_remove("NOTIFY_SOCKET").env_remove("WATCHDOG_USEC").env_remove("JOURNAL_STREAM");
    cmd
}

/// Where the workers of a test write, printed if the test fails.
struct Logs(tempfile::TempDir);

impl Logs {
    fn new() -> Logs {
        Logs(tempfile::tempdir().unwrap())
    }

    /// Standard output and error files for worker `i`.
    fn files(&self, i: usize) -> (std::fs::File, std::fs::File) {
        let open = |name: String| std::fs::File::create(self.0.path().join(name)).unwrap();
        (open(format!("{i}.out")), open(format!("{i}.err")))
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut names: Vec<_> = std::fs::read_dir(self.0.path()).unwrap().map(|e| e.unwrap().path()).collect();
            names.sort();
            for path in names {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                eprintln!("--- {}:\n{text}", path.display());
            }
        }
    }
}

/// The first index of a message with the line `line`.
fn first(messages: &[(Instant, String)], line: &str) -> Option<usize> {
    messages.iter().position(|(_, m)| m.lines().any(|l| l == line || (line.ends_with('=') && l.starts_with(line))))
}

/// Reads a child's standard output line by line on a thread; the lines so far.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, needle: &str, timeout: Duration) -> String {
    let until = Instant::now() + timeout;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(_) => {}
            Err(_) => panic!("no line with {needle:?} within {timeout:?}"),
        }
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

fn alive(child: &mut Child) -> bool {
    child.try_wait().unwrap().is_none()
}

#[test]
fn systemd_sees_ready_status_watchdog_and_stopping_in_order() {
    let mut socket = NotifySocket::new();
    // STATUS is sent at most once a second: the run must train well over a second after READY
    // for a status naming an epoch to come (3 epochs of the fixture took ~1.3 s, and lost that
    // race about once in ten runs).
    let out =
        run_cmd(fixture(2000, 6)).env("NOTIFY_SOCKET", &socket.path).env("WATCHDOG_USEC", "200000").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    std::thread::sleep(Duration::from_millis(100));
    let m = socket.messages().to_vec();
    let ready = first(&m, "READY=1").unwrap_or_else(|| panic!("no READY: {m:?}"));
    let status = m.iter().skip(ready).position(|(_, x)| x.contains("STATUS=epoch ")).map(|i| i + ready);
    let ping = m.iter().skip(ready + 1).position(|(_, x)| x.lines().any(|l| l == "WATCHDOG=1")).map(|i| i + ready + 1);
    let stopping = first(&m, "STOPPING=1").unwrap_or_else(|| panic!("no STOPPING: {m:?}"));
    let (status, ping) = (status.expect("a STATUS after READY"), ping.expect("a ping after READY"));
    assert!(ready <= status && status < stopping && ping < stopping, "out of order: {m:?}");
    assert!(m[ready].1.contains("STATUS="), "READY comes with a status: {}", m[ready].1);
    assert!(
        m.iter().any(|(_, x)| x.contains("STATUS=epoch ") && x.contains(", step ") && x.contains(", loss ")),
        "the status names epoch, step and loss: {m:?}"
    );
    assert!(m[stopping..].iter().all(|(_, x)| !x.contains("READY=1")), "{m:?}");
}

#[test]
fn sigterm_sends_stopping_and_a_hung_step_stops_the_pings() {
    // SIGTERM: STOPPING at once, then a clean exit.
    let mut socket = NotifySocket::new();
    let mut child = run_cmd(fixture(2000, 20))
        .env("NOTIFY_SOCKET", &socket.path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    socket.wait_for("READY=1", Duration::from_secs(60));
    socket.wait_for("WATCHDOG=1", Duration::from_secs(10));
    signal(&child, libc::SIGTERM);
    socket.wait_for("STOPPING=1", Duration::from_secs(5));
    assert!(child.wait().unwrap().success());

    // A step that never ends (the failpoint holds it, as a stuck kernel would): the pings stop
    // within the stall period, and /healthz says so, while the process lives on.
    let mut socket = NotifySocket::new();
    let mut child = run_cmd(fixture(2000, 1))
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("NOTIFY_SOCKET", &socket.path)
        .env("WATCHDOG_USEC", "400000")
        .env("TRAINERD_FAILPOINT", "train-step@30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut child);
    let addr = metrics_addr(&wait_line(&lines, "trainerd: metrics on", Duration::from_secs(60)));
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("failpoint train-step reached") {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the failpoint was never reached");
    }
    let hung = Instant::now();
    assert!(socket.pings_after(hung - Duration::from_secs(1)) > 0, "pings while training");
    std::thread::sleep(Duration::from_millis(600));
    let quiet_since = socket.mark();
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(socket.pings_sent_after(&quiet_since), 0, "pings after the step hung: {:?}", socket.messages());
    let (code, body) = http_get(&addr, "/healthz", None);
    assert_eq!(code, 503, "{body}");
    assert!(body.starts_with("unhealthy: no training progress for "), "{body}");
    assert!(alive(&mut child), "the process lives on: systemd is who ends it");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_frozen_peer_stops_pinging_while_the_survivor_pings_through_its_bounded_wait() {
    let ports = free_ports(2);
    let mut sockets = [NotifySocket::new(), NotifySocket::new()];
    let logs = Logs::new();
    let mut workers: Vec<Child> = (0..2)
        .map(|i| {
            let (out, err) = logs.files(i);
            run_cmd(fixture(2000, 5))
                .env("TF_CONFIG", tf_config(&ports, i))
                .env("NOTIFY_SOCKET", &sockets[i].path)
                .env("WATCHDOG_USEC", "400000")
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap()
        })
        .collect();
    for s in sockets.iter_mut() {
        s.wait_for("READY=1", Duration::from_secs(60));
    }
    sockets[1].wait_for("STATUS=epoch ", Duration::from_secs(30));
    signal(&workers[1], libc::SIGSTOP);
    let frozen = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let later = sockets[1].mark();
    sockets[0].wait_for("STATUS=re-forming: ", Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(sockets[1].pings_sent_after(&later), 0, "the frozen worker cannot ping");
    assert!(
        sockets[0].pings_after(frozen + Duration::from_secs(1)) >= 3,
        "the survivor waits, alive: {:?}",
        sockets[0].messages()
    );
    signal(&workers[1], libc::SIGCONT);
    for (i, w) in workers.iter_mut().enumerate() {
        let status = w.wait().unwrap();
        assert!(status.success(), "worker {i}: {status}");
    }
    for s in sockets.iter_mut() {
        s.wait_for("STOPPING=1", Duration::from_secs(5));
    }
}

/// `127.0.0.1:PORT` from `trainerd: metrics on http://127.0.0.1:PORT/metrics, ...`.
fn metrics_addr(line: &str) -> String {
    let rest = line.split("http://").nth(1).unwrap();
    rest.split('/').next().unwrap().to_string()
}

/// A GET with an optional bearer token: status code and body.
fn http_get(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let code = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (code, body)
}

/// Parses OpenMetrics text with the `prometheus_client` package; `{name: [(labels, value)]}`.
fn parse_metrics(body: &str) -> serde_json::Value {
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.setdefault(s.name, []).append([s.labels, s.value])
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/setup.sh installs prometheus_client in the venv on PATH)");
    child.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the OpenMetrics parser refused the text: {}\n{body}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn sample(metrics: &serde_json::Value, name: &str) -> f64 {
    metrics[name][0][1].as_f64().unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

#[test]
fn metrics_are_scraped_during_training_and_parse_as_openmetrics() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "metrics-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token_file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let ports = free_ports(2);
    // The chief holds still in the middle of epoch 3 (after two evaluations and several commits)
    // while the test scrapes it.
    let mut workers: Vec<Child> = (0..2)
        .map(|i| {
            let mut run = fixture(300, 3);
            if i == 0 {
                run =
                    run.set("--metrics-addr", "127.0.0.1:0").set("--metrics-token-file", token_file.to_str().unwrap());
                run = run.checkpoints(dir.path().join("ckpt"), 100);
            }
            let mut cmd = run_cmd(run);
            if i == 0 {
                cmd.env("TRAINERD_FAILPOINT", "train-step@611");
            }
            cmd.env("TF_CONFIG", tf_config(&ports, i)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let lines = lines_of(&mut workers[0]);
    let addr = metrics_addr(&wait_line(&lines, "trainerd: metrics on", Duration::from_secs(60)));
    assert_eq!(http_get(&addr, "/metrics", None), (401, "unauthorized\n".into()), "no token, no metrics");
    assert_eq!(http_get(&addr, "/metrics", Some("wrong-token-0123456789")).0, 401);
    let mut stderr = BufReader::new(workers[0].stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("failpoint train-step reached") {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the failpoint was never reached");
    }
    let (code, body) = http_get(&addr, "/metrics", Some("metrics-token-0123456789"));
    assert_eq!(code, 200, "{body}");
    assert!(alive(&mut workers[0]), "scraped during training");
    let m = parse_metrics(&body);
    assert_eq!(sample(&m, "trainerd_steps_total"), 610.0, "{m}");
    assert_eq!(sample(&m, "trainerd_global_step"), 610.0);
    assert_eq!(sample(&m, "trainerd_epoch"), 3.0);
    assert!(sample(&m, "trainerd_examples_total") > 0.0);
    assert!(sample(&m, "trainerd_examples_per_second") > 0.0);
    assert!(sample(&m, "trainerd_learning_rate") > 0.0);
    assert!(sample(&m, "trainerd_allreduce_bytes_total") > 0.0);
    assert!(sample(&m, "trainerd_allreduce_seconds_total") > 0.0);
    assert!(sample(&m, "trainerd_commits_total") >= 4.0, "{m}");
    assert!(sample(&m, "trainerd_commit_bytes_total") > 0.0);
    assert_eq!(sample(&m, "trainerd_commit_failures_total"), 0.0);
    assert!(sample(&m, "trainerd_commit_seconds_count") >= 4.0);
    assert_eq!(sample(&m, "trainerd_failures_detected_total"), 0.0);
    assert_eq!(sample(&m, "trainerd_recoveries_total"), 0.0);
    assert_eq!(sample(&m, "trainerd_steps_lost_total"), 0.0);
    assert_eq!(sample(&m, "trainerd_recovery_seconds_count"), 0.0);
    assert!(sample(&m, "trainerd_generation") >= 1.0);
    assert_eq!(sample(&m, "trainerd_peers_up"), 2.0);
    let losses = m["trainerd_loss"].as_array().unwrap();
    for split in ["train", "validation"] {
        assert!(losses.iter().any(|s| s[0]["split"] == split && s[1].as_f64().unwrap() > 0.0), "{split}: {m}");
    }
    let accuracy = m["trainerd_metric"].as_array().unwrap();
    assert!(accuracy.iter().any(|s| s[0]["name"] == "accuracy" && s[0]["split"] == "validation"), "{m}");
    assert_eq!(http_get(&addr, "/healthz", None), (200, "ok\n".into()));
    for w in workers.iter_mut() {
        w.kill().unwrap();
        w.wait().unwrap();
    }
}

/// `control A, data B` from `trainerd: listening on control A, data B (...)`.
fn listening(line: &str) -> (String, String) {
    let rest = line.split("listening on control ").nth(1).unwrap();
    let (control, rest) = rest.split_once(", data ").unwrap();
    (control.to_string(), rest.split(' ').next().unwrap().to_string())
}

fn secret(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

/// What a client that does not know the secret gets from `addr` after sending `hello`.
fn unauthenticated(addr: &str, hello: &[u8]) -> Vec<u8> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(hello);
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got
}

#[test]
fn clients_without_the_secret_are_refused_on_every_port_and_learn_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let right = secret(dir.path(), "secret", "the-cluster-secret-0123456789\n");
    let wrong = secret(dir.path(), "other", "another-cluster-secret-987654321\n");
    let ports = free_ports(2);
    let spawn = |i: usize, file: &Path, timeout: &str| {
        run_cmd(fixture(60, 1).set("--rendezvous-timeout", timeout).set("--secret-file", file.to_str().unwrap()))
            .env("TF_CONFIG", tf_config(&ports, i))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut chief = spawn(0, &right, "60");
    let lines = lines_of(&mut chief);
    let (control, data) = listening(&wait_line(&lines, "trainerd: listening on", Duration::from_secs(60)));
    // A gRPC client, and a ring peer, that know nothing: each gets the 40-byte challenge, then
    // the connection is closed; nothing names the cluster.
    for (addr, hello) in [(&control, &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..]), (&data, &[0u8; 24][..])] {
        let got = unauthenticated(addr, hello);
        assert_eq!(got.len(), 40, "{addr}: {got:?}");
        assert_eq!(&got[..8], b"TRDAUTH1");
    }
    // A worker with another secret is refused, and says why.
    let impostor = spawn(1, &wrong, "3").wait_with_output().unwrap();
    assert_eq!(impostor.status.code(), Some(1), "{}", text(&impostor));
    let err = error_line(&impostor);
    assert!(err.contains("the cluster secrets differ (is the same --secret-file set on every worker?)"), "{err}");
    // The real worker 1 joins; the run completes.
    let mut worker = spawn(1, &right, "60");
    let worker_out = std::thread::spawn(move || {
        let mut s = String::new();
        worker.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        (worker.wait().unwrap(), s)
    });
    wait_line(&lines, "done: ", Duration::from_secs(120));
    assert!(chief.wait().unwrap().success());
    let (status, out) = worker_out.join().unwrap();
    assert!(status.success(), "{out}");
    let mut log = String::new();
    chief.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    for plane in ["control plane", "data plane"] {
        assert!(
            log.contains("WARN trainerd::") && log.contains(&format!("{plane}: refused a connection from 127.0.0.1:")),
            "{plane} refusals are logged: {log}"
        );
    }
    assert!(log.contains("it did not prove that it knows the cluster secret"), "{log}");
}

#[test]
fn clusters_across_hosts_need_a_secret_and_files_others_can_write_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cluster =
        r#"{"cluster": {"worker": ["127.0.0.1:1", "192.0.2.7:2222"]}, "task": {"type": "worker", "index": 0}}"#;
    let out = run_cmd(fixture(1, 1)).env("TF_CONFIG", cluster).output().unwrap();
    assert_eq!(
        error_of(&out),
        "error: TF_CONFIG puts worker 1 at 192.0.2.7:2222, which is not a loopback address: a cluster across hosts \
         needs a shared secret so that nobody else on the network can join it or read it. Give every worker the \
         same --secret-file (TRAINERD_SECRET_FILE), or pass --insecure to run without one"
    );
    let open = dir.path().join("secret");
    std::fs::write(&open, "the-cluster-secret-0123456789").unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out =
        run_cmd(fixture(1, 1).set("--secret-file", open.to_str().unwrap())).env("TF_CONFIG", cluster).output().unwrap();
    assert_eq!(
        error_of(&out),
        format!("error: --secret-file {0}: every user can read it (mode 0644); run `chmod 600 {0}`", open.display())
    );
    // A plugin every user can write.
    let copy = dir.path().join("libtest_fixture.so");
    std::fs::copy(plugin("test-fixture"), &copy).unwrap();
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = RunArgs::with_plugin(&copy).command("run").output().unwrap();
    assert_eq!(
        error_of(&out),
        format!(
            "error: plugin {0}: refused: every user can write it (mode 0777); run `chmod go-w {0}` (whoever can write \
             a plugin runs code as trainerd)",
            copy.display()
        )
    );
    let out = trainerd_cmd().args(["plugin", "check"]).arg(&copy).output().unwrap();
    assert!(!out.status.success() && text(&out).contains("refused: every user can write it"), "{}", text(&out));
    let out = run_cmd(fixture(1, 1).set("--metrics-addr", "0.0.0.0:0")).output().unwrap();
    assert_eq!(
        error_of(&out),
        "error: --metrics-addr 0.0.0.0:0 is not a loopback address: give --metrics-token-file so that only your \
         Prometheus can read the metrics, or pass --insecure"
    );
}

#[test]
fn nothing_written_to_a_pipe_or_the_journal_holds_an_escape_code() {
    let ports = free_ports(1);
    // One worker in a TF_CONFIG cluster with --insecure: a warning on standard error.
    let out = run_cmd(fixture(30, 1).on("--insecure")).env("TF_CONFIG", tf_config(&ports, 0)).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let all = text(&out);
    assert!(all.contains("WARN trainerd: --insecure: the cluster's ports accept anyone"), "{all}");
    assert!(!all.contains('\x1b'), "escape codes in: {all:?}");

    // Standard error is the journal (JOURNAL_STREAM names it): priorities, no time, no escapes.
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("stderr");
    let err_file = std::fs::File::create(&err_path).unwrap();
    let meta = std::os::unix::fs::MetadataExt::ino(&err_file.metadata().unwrap());
    let dev = std::os::unix::fs::MetadataExt::dev(&err_file.metadata().unwrap());
    let out = run_cmd(fixture(30, 1).on("--insecure"))
        .env("TF_CONFIG", tf_config(&ports, 0))
        .env("JOURNAL_STREAM", format!("{dev}:{meta}"))
        .stderr(err_file)
        .output()
        .unwrap();
    assert!(out.status.success());
    let journal = std::fs::read_to_string(&err_path).unwrap();
    assert!(journal.lines().any(|l| l.starts_with("<4>WARN trainerd: --insecure")), "{journal}");
    assert!(!journal.contains('\x1b'));

    // JSON: every line of both streams is an object.
    let out = run_cmd(fixture(30, 1).on("--insecure").set("--log-format", "json"))
        .env("TF_CONFIG", tf_config(&ports, 0))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    for line in String::from_utf8(out.stdout).unwrap().lines().chain(String::from_utf8(out.stderr).unwrap().lines()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn the_unit_verifies_and_its_environment_file_holds_a_whole_tf_config() {
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(repo().join("systemd/trainerd@.service")).unwrap();
    // systemd-analyze checks that the binary exists: point the unit at the one under test.
    let unit = unit.replace("/usr/local/bin/trainerd", env!("CARGO_BIN_EXE_trainerd"));
    let instance = dir.path().join("trainerd@mnist.service");
    std::fs::write(&instance, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&instance)
        .output()
        .expect("systemd-analyze (scripts/setup.sh installs systemd's tools)");
    assert!(out.status.success() && out.stderr.is_empty(), "{}", text(&out));
    // A unit with a mistake is reported, so the check above means something.
    let broken = std::fs::read_to_string(&instance).unwrap().replace("WatchdogSec=60", "WatchdogSecs=60");
    std::fs::write(&instance, broken).unwrap();
    let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&instance).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("Unknown key") && said.contains("WatchdogSecs"), "{}", text(&out));

    // The example environment file, read as systemd reads it (shell-like quoting).
    let env = repo().join("systemd/trainerd.env.example");
    let out = Command::new("bash")
        .arg("-c")
        .arg("set -a; . \"$1\"; printf %s \"$TF_CONFIG\"")
        .arg("-")
        .arg(&env)
        .output()
        .unwrap();
    let tf: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(tf["task"]["index"], 0, "{tf}");
}

/// The manifest as JSON (PyYAML reads it, as kubectl would).
fn manifest() -> Vec<serde_json::Value> {
    let out = Command::new("python3")
        .args(["-c", "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))"])
        .arg(repo().join("deploy/kubernetes/trainerd-tfjob.yaml"))
        .output()
        .expect("python3 with PyYAML (scripts/setup.sh)");
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_kubernetes_workers_arguments_run_under_the_tf_config_a_tfjob_gives() {
    let docs = manifest();
    let job = docs.iter().find(|d| d["kind"] == "TFJob").expect("a TFJob");
    let worker = &job["spec"]["tfReplicaSpecs"]["Worker"];
    let pod = &worker["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["command"], serde_json::json!(["/usr/local/bin/trainerd", "run"]));
    assert_eq!(pod["volumes"][0]["secret"]["defaultMode"], 0o440, "the secret is not readable by every user");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    // The operator's TF_CONFIG for worker 1 (its services' names; port 2222 made a free one).
    let port = free_ports(1)[0];
    let replicas = worker["replicas"].as_u64().unwrap();
    let names: Vec<String> = (0..replicas).map(|i| format!("trainerd-mnist-worker-{i}.default.svc:{port}")).collect();
    let tf_config = serde_json::json!({
        "cluster": {"worker": names},
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    });
    // The pod's files, here: the secret volume as Kubernetes mounts it (mode 0440).
    let dir = tempfile::tempdir().unwrap();
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    let local = |arg: &str| -> String {
        let (flag, value) = arg.split_once('=').unwrap();
        let value = match flag {
            "--plugin" => plugin("test-fixture").display().to_string(),
            "--data" => dataset().display().to_string(),
            "--checkpoint-dir" => dir.path().join("ckpt").display().to_string(),
            "--summary" => dir.path().join("summary.json").display().to_string(),
            "--metrics-addr" => "127.0.0.1:0".into(),
            _ if value.starts_with(mount) => {
                let path = dir.path().join(value.rsplit('/').next().unwrap());
                std::fs::write(&path, "a-secret-from-kubernetes-0123456789").unwrap();
                std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o440)).unwrap();
                path.display().to_string()
            }
            _ => value.to_string(),
        };
        format!("{flag}={value}")
    };
    let args: Vec<String> = container["args"].as_array().unwrap().iter().map(|a| local(a.as_str().unwrap())).collect();
    let out = RunArgs::default()
        .extend(&args)
        .set("--listen", "127.0.0.1")
        .set("--rendezvous-timeout", 1)
        .command("run")
        .env("TF_CONFIG", tf_config.to_string())
        .output()
        .unwrap();
    // Everything is accepted up to the rendezvous, which needs the chief's pod.
    let err = error_of(&out);
    assert!(
        err.starts_with(&format!(
            "error: rendezvous: no answer from the chief, worker 0 (trainerd-mnist-worker-0.default.svc:{port}), within 1s"
        )),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("(peers must prove the cluster secret)"), "{}", text(&out));
}
