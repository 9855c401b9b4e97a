//! Failpoints for chaos tests: named places in the code where a test can stop the process, to
//! kill it exactly there (in the middle of a commit, in the middle of an all-reduce), or make it
//! do a fault on purpose (flip a bit of its state, as faulty memory would).
//!
//! `TRAINERD_FAILPOINT=NAME@N` arms the N-th time the process reaches NAME (counting from 1);
//! `TRAINERD_FAILPOINT=NAME@step=S` arms the first time it reaches NAME from the start of global
//! step S (1-based, as the training loop says with [`set_step`]) until step S+1 starts: in the
//! step, its comparison of the replicas and its commit, or a formation that follows it. So a
//! test's point falls on the step it means whatever else the process did before (a recovery's extra all-reduces, a
//! comparison of the replicas). Several points, each counted on its own, are armed at once by a
//! comma-separated list (`flip-bit@30,replica-mismatch@1`). A point reached inside a [`region`]
//! (a guard the code holds around a phase, such as the comparison of the replicas) is also
//! reached as `REGION/NAME` (`replica-check/all-gather@step=40`: that all-gather, not the step's
//! own). A [`point`] pauses there, for good or, when
//! `TRAINERD_FAILPOINT_RELEASE` names a file, until that file exists (taking it); a [`hit`] says so to its
//! caller; both print `trainerd: failpoint NAME reached` to standard error (NAME as armed). Unset, as in
//! production, a point costs one check of an initialised value.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The variable that arms failpoints.
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

/// One armed point: its name (possibly `REGION/NAME`), which visit, and its visits so far.
#[derive(Debug)]
struct Armed {
    name: String,
    when: When,
    reached: AtomicU64,
}

static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();
/// The global step being trained (1-based; 0 before the first).
static STEP: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The region this thread is in, if any.
    static REGION: Cell<Option<&'static str>> = const { Cell::new(None) };
    /// The global step this thread works for, where it is not the one being trained (a thread
    /// writing a commit's parts in the background while the loop trains on).
    static THREAD_STEP: Cell<Option<u64>> = const { Cell::new(None) };
}

/// `NAME@N` or `NAME@step=S` as (NAME, when); `None` when absent or not of that form.
fn parse(value: &str) -> Option<(String, When)> {
    let (name, at) = value.rsplit_once('@')?;
    let when = match at.strip_prefix("step=") {
        Some(step) => When::Step(step.parse().ok().filter(|&s| s > 0)?),
        None => When::Visit(at.parse().ok().filter(|&n| n > 0)?),
    };
    Some((name.to_string(), when))
}

/// Every well-formed point of a comma-separated list.
fn parse_all(value: &str) -> Vec<Armed> {
    let armed = value.split(',').filter_map(|v| parse(v.trim()));
    armed.map(|(name, when)| Armed { name, when, reached: AtomicU64::new(0) }).collect()
}

fn armed() -> &'static [Armed] {
    ARMED.get_or_init(|| std::env::var(VARIABLE).map(|v| parse_all(&v)).unwrap_or_default())
}

/// The training loop is at global step `step` (1-based): what `NAME@step=S` is armed by.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// The global step being trained, as last set ([`set_step`]).
pub fn step() -> u64 {
    STEP.load(Ordering::Relaxed)
}

/// This thread works for global step `step` from now on, whatever step the loop is training:
/// `NAME@step=S` is armed by that, here (a background writer of step S's commit).
pub fn set_thread_step(step: u64) {
    THREAD_STEP.with(|s| s.set(Some(step)));
}

/// Held while the code is in the region it was made for ([`region`]).
#[must_use = "the region ends when the guard is dropped"]
pub struct Region {
    outer: Option<&'static str>,
}

impl Drop for Region {
    fn drop(&mut self) {
        REGION.with(|r| r.set(self.outer));
    }
}

/// Enters the region `name` on this thread until the guard is dropped: a point reached meanwhile
/// is also reached as `name/POINT`.
pub fn region(name: &'static str) -> Region {
    if armed().is_empty() {
        return Region { outer: REGION.with(Cell::get) };
    }
    Region { outer: REGION.with(|r| r.replace(Some(name))) }
}

/// Whether `wanted` (as armed) names the point `name` reached in `region`.
fn names(wanted: &str, name: &str, region: Option<&str>) -> bool {
    wanted == name || region.is_some_and(|r| wanted.strip_prefix(r).and_then(|w| w.strip_prefix('/')) == Some(name))
}

/// Whether a failpoint armed for `name` is armed for this visit (said on standard error).
pub fn hit(name: &str) -> bool {
    let armed = armed();
    if armed.is_empty() {
        return false;
    }
    let region = REGION.with(Cell::get);
    let step = THREAD_STEP.with(Cell::get).unwrap_or_else(|| STEP.load(Ordering::Relaxed));
    let mut now = false;
    for point in armed.iter().filter(|p| names(&p.name, name, region)) {
        let here = match point.when {
            When::Visit(n) => point.reached.fetch_add(1, Ordering::SeqCst) + 1 == n,
            // Once only: the first visit in that step takes it.
            When::Step(s) => step == s && point.reached.fetch_add(1, Ordering::SeqCst) == 0,
        };
        if here {
            eprintln!("trainerd: failpoint {} reached", point.name);
            now = true;
        }
    }
    now
}

/// Marks the failpoint `name`: pauses here if it is armed and this is the visit it names, for
/// good, or until the file named by [`RELEASE`] exists. The file is taken (removed) as it
/// releases the point, so that a test releases each pause with a file of its own making: where
/// several processes pause on one file, each file made releases exactly one of them.
pub fn point(name: &str) {
    if !hit(name) {
        return;
    }
    match std::env::var_os(RELEASE) {
        Some(file) => released_by(std::path::Path::new(&file)),
        None => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    }
}

/// Returns once this caller has taken `file`: removed it, which one caller alone does of those
/// waiting on it (checking that it exists first let two see it and both go on, 2026-11-30).
fn released_by(file: &std::path::Path) {
    while std::fs::remove_file(file).is_err() {
        std::thread::sleep(Duration::from_millis(5));
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

    #[test]
    fn a_list_arms_each_of_its_well_formed_points() {
        let armed = parse_all("flip-bit@30, replica-mismatch@1,bad");
        let names: Vec<(&str, &When)> = armed.iter().map(|a| (a.name.as_str(), &a.when)).collect();
        assert_eq!(names, vec![("flip-bit", &When::Visit(30)), ("replica-mismatch", &When::Visit(1))]);
    }

    #[test]
    fn each_release_file_made_releases_exactly_one_of_those_waiting_on_it() {
        let dir = std::env::temp_dir().join(format!("trainerd-failpoint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("release");
        let released = std::sync::Arc::new(AtomicU64::new(0));
        for _ in 0..8 {
            let (file, released) = (file.clone(), released.clone());
            std::thread::spawn(move || {
                released_by(&file);
                released.fetch_add(1, Ordering::SeqCst);
            });
        }
        for made in 1..=5 {
            std::fs::write(&file, b"").unwrap();
            while file.exists() {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(released.load(Ordering::SeqCst), made, "after {made} file(s)");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_point_in_a_region_is_reached_under_both_names() {
        assert!(names("all-gather", "all-gather", None));
        assert!(names("all-gather", "all-gather", Some("replica-check")));
        assert!(names("replica-check/all-gather", "all-gather", Some("replica-check")));
        assert!(!names("replica-check/all-gather", "all-gather", None));
        assert!(!names("replica-check/all-gather", "all-gather", Some("formed")));
        assert!(!names("replica-check/all-gather", "all-gather-late", Some("replica-check")));
    }
}
