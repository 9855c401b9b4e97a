//! Failpoints for chaos tests: named places in the code where a test can stop the process, to
//! kill it exactly there (in the middle of a commit, in the middle of an all-reduce), or make it
//! do a fault on purpose (flip a bit of its state, as faulty memory would).
//! `TRAINERD_FAILPOINT=NAME@N` arms the N-th time the process reaches NAME (counting from 1): a
//! [`point`] pauses there for good, a [`hit`] says so to its caller; both print
//! `trainerd: failpoint NAME reached` to standard error. Unset, as in production, a point costs
//! one check of an initialised value.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The variable that arms a failpoint.
pub const VARIABLE: &str = "TRAINERD_FAILPOINT";

static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
static REACHED: AtomicU64 = AtomicU64::new(0);

/// `NAME@N` as (NAME, N); `None` when absent or not of that form.
fn parse(value: &str) -> Option<(String, u64)> {
    let (name, n) = value.rsplit_once('@')?;
    Some((name.to_string(), n.parse().ok().filter(|&n| n > 0)?))
}

/// Whether the failpoint `name` is armed and this is its N-th visit (said on standard error).
pub fn hit(name: &str) -> bool {
    let armed = ARMED.get_or_init(|| std::env::var(VARIABLE).ok().as_deref().and_then(parse));
    let Some((wanted, n)) = armed else { return false };
    if wanted != name || REACHED.fetch_add(1, Ordering::SeqCst) + 1 != *n {
        return false;
    }
    eprintln!("trainerd: failpoint {name} reached");
    true
}

/// Marks the failpoint `name`: pauses here for good if it is armed and this is its N-th visit.
pub fn point(name: &str) {
    if !hit(name) {
        return;
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_name_at_a_positive_count_arms_a_point() {
        assert_eq!(parse("all-gather@12"), Some(("all-gather".into(), 12)));
        assert_eq!(parse("a@b@3"), Some(("a@b".into(), 3)));
        assert_eq!(parse("all-gather"), None);
        assert_eq!(parse("all-gather@0"), None);
        assert_eq!(parse("x@-1"), None);
    }
}
