//! Failpoints for chaos tests: named places in the code where a test can stop the process, to
//! kill it exactly there (in the middle of a commit, in the middle of an all-reduce), or make it
//! do a fault on purpose (flip a bit of its state, as faulty memory would).
//!
//! `TRAINERD_FAILPOINT=NAME@N` arms the N-th time the process reaches NAME (counting from 1);
//! `TRAINERD_FAILPOINT=NAME@step=S` arms the first time it reaches NAME from the start of global
//! step S (1-based, as the training loop says with [`set_step`]) until step S+1 starts: in the
//! step, its comparison of the replicas and its commit, or a formation that follows it. So a
//! test's point falls on the step it means whatever else the process did before (a recovery's extra all-reduces, a
//! comparison of the replicas). A [`point`] pauses there, for good or, when
//! `TRAINERD_FAILPOINT_RELEASE` names a file, until that file exists; a [`hit`] says so to its
//! caller; both print `trainerd: failpoint NAME reached` to standard error. Unset, as in
//! production, a point costs one check of an initialised value.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The variable that arms a failpoint.
pub const VARIABLE: &str = "TRAINERD_FAILPOINT";
/// The variable naming a file whose creation releases a paused point.
pub const RELEASE: &str = "TRAINERD_FAILPOINT_RELEASE";

/// Which visit of a point arms it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum When {
    /// The N-th visit (from 1).
    Visit(u64),
    /// The first visit from the start of global step S until step S+1 starts.
    Step(u64),
}

static ARMED: OnceLock<Option<(String, When)>> = OnceLock::new();
static REACHED: AtomicU64 = AtomicU64::new(0);
/// The global step being trained (1-based; 0 before the first).
static STEP: AtomicU64 = AtomicU64::new(0);

/// `NAME@N` or `NAME@step=S` as (NAME, when); `None` when absent or not of that form.
fn parse(value: &str) -> Option<(String, When)> {
    let (name, at) = value.rsplit_once('@')?;
    let when = match at.strip_prefix("step=") {
        Some(step) => When::Step(step.parse().ok().filter(|&s| s > 0)?),
        None => When::Visit(at.parse().ok().filter(|&n| n > 0)?),
    };
    Some((name.to_string(), when))
}

/// The training loop is at global step `step` (1-based): what `NAME@step=S` is armed by.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// Whether the failpoint `name` is armed and this is the visit it names (said on standard error).
pub fn hit(name: &str) -> bool {
    let armed = ARMED.get_or_init(|| std::env::var(VARIABLE).ok().as_deref().and_then(parse));
    let Some((wanted, when)) = armed else { return false };
    if wanted != name {
        return false;
    }
    let now = match *when {
        When::Visit(n) => REACHED.fetch_add(1, Ordering::SeqCst) + 1 == n,
        // Once only: the first visit in that step takes it.
        When::Step(s) => STEP.load(Ordering::Relaxed) == s && REACHED.fetch_add(1, Ordering::SeqCst) == 0,
    };
    if now {
        eprintln!("trainerd: failpoint {name} reached");
    }
    now
}

/// Marks the failpoint `name`: pauses here if it is armed and this is the visit it names, for
/// good, or until the file named by [`RELEASE`] exists.
pub fn point(name: &str) {
    if !hit(name) {
        return;
    }
    let release = std::env::var_os(RELEASE).map(std::path::PathBuf::from);
    loop {
        match &release {
            Some(file) if file.exists() => return,
            Some(_) => std::thread::sleep(Duration::from_millis(5)),
            None => std::thread::sleep(Duration::from_secs(3600)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_name_at_a_positive_count_or_step_arms_a_point() {
        assert_eq!(parse("all-gather@12"), Some(("all-gather".into(), When::Visit(12))));
        assert_eq!(parse("a@b@3"), Some(("a@b".into(), When::Visit(3))));
        assert_eq!(parse("all-gather@step=96"), Some(("all-gather".into(), When::Step(96))));
        assert_eq!(parse("all-gather"), None);
        assert_eq!(parse("all-gather@0"), None);
        assert_eq!(parse("all-gather@step=0"), None);
        assert_eq!(parse("all-gather@step=x"), None);
        assert_eq!(parse("x@-1"), None);
    }
}
