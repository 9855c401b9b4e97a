//! The digests a comparison of the replicas exchanges: a state's, its parameters' and the rest's
//! (under sharding), each range's copy's, gathered from every member in one all-reduce, and what
//! they say (the parameters alone differing, two copies of a range differing).

use xxhash_rust::xxh3::Xxh3;

use super::{verdict, Verdict};
use crate::state::{Optim, Shareable, StateError, TrainState};
use crate::train::session::{Interrupt, Session};

/// The odd members' names (places `odd`, by their parameters' `digests`), and what differs: `the
/// parameters of worker 2 (…) differ from those of worker 0 (…), … (xxh3 X against Y)`.
pub(super) fn parameters(session: &Session, digests: &[u64], odd: &[usize]) -> (Vec<String>, String) {
    let names = |places: &mut dyn Iterator<Item = usize>| places.map(|p| session.name_at(p)).collect::<Vec<_>>();
    let right: Vec<usize> = (0..digests.len()).filter(|p| !odd.contains(p)).collect();
    let found: Vec<String> = odd.iter().map(|&p| format!("{:016x}", digests[p])).collect();
    let odd = names(&mut odd.iter().copied());
    let said = format!(
        "the parameters of {} differ from those of {} (xxh3 {} against {:016x})",
        odd.join(", "),
        names(&mut right.iter().copied()).join(", "),
        found.join(", "),
        right.first().map_or(0, |&p| digests[p])
    );
    (odd, said)
}

/// Per range of a sharded optimizer's `ranges` (none otherwise), this member's copy's digest if it
/// holds one.
pub(super) fn range_digests(state: &TrainState, ranges: usize) -> Vec<Option<u64>> {
    let mut out = vec![None; ranges];
    if let Optim::Sharded(o) = &state.optimizer {
        o.digests().into_iter().filter(|&(r, _)| r < ranges).for_each(|(r, d)| out[r] = Some(d));
    }
    out
}

/// Per member, its state's digest, its parameters' and the rest's (under sharding), and, per
/// range, its copy's (if it holds one).
pub(super) type Exchanged = (Vec<u64>, Vec<(u64, u64)>, Vec<Vec<Option<u64>>>);

/// Every member's `digest` (with its parameters' and the rest's), its `ranges`' digests and the
/// coordinator's place, by one all-reduce: each member puts its digests' halves (a range's after
/// a 1 when it holds it, and a 1 when it coordinates) in its own place of zeros; the sum is then
/// every member's value, exactly.
pub(super) fn exchange(
    session: &mut Session,
    (digest, (params, rest)): (u64, (u64, u64)),
    coordinates: bool,
    ranges: &[Option<u64>],
) -> Result<(Exchanged, usize), Interrupt> {
    let halves = |d: u64| [(d >> 32) as f64, (d & 0xffff_ffff) as f64];
    let whole = |v: &[f64]| ((v[0] as u64) << 32) | v[1] as u64;
    let mut mine = vec![if coordinates { 1.0 } else { 0.0 }];
    [digest, params, rest].into_iter().for_each(|d| mine.extend(halves(d)));
    for r in ranges {
        mine.push(if r.is_some() { 1.0 } else { 0.0 });
        mine.extend(halves(r.unwrap_or(0)));
    }
    let values = session.gather(&mine)?;
    let rows: Vec<&[f64]> = values.chunks(mine.len()).collect();
    let digests = rows.iter().map(|v| whole(&v[1..3])).collect();
    let split = rows.iter().map(|v| (whole(&v[3..5]), whole(&v[5..7]))).collect();
    let held = rows.iter().map(|v| v[7..].chunks(3).map(|c| (c[0] > 0.5).then(|| whole(&c[1..]))).collect()).collect();
    let coordinator = rows.iter().position(|v| v[0] > 0.5).unwrap_or(0);
    Ok(((digests, split, held), coordinator))
}

/// Under sharding, where the replicated states differ (`whole`, the verdict on their digests): the
/// places whose parameters alone differ from a strict majority's (`split`: per member, its
/// parameters' digest and the rest's), the rest being equal everywhere; `None` otherwise.
pub(super) fn parameters_alone(split: &[(u64, u64)], whole: &Verdict) -> Option<Vec<usize>> {
    if split.iter().any(|s| s.1 != split[0].1) {
        return None;
    }
    let params: Vec<u64> = split.iter().map(|s| s.0).collect();
    let found = verdict(&params, 0)?;
    let majority = 2 * (params.len() - found.odd.len()) > params.len();
    (majority && found.odd == whole.odd).then_some(found.odd)
}

/// A sharded state's digests of its parameters (as the per-step check hashes them) and of the
/// rest of its replicated state (its buffers' bytes and its position).
pub(super) fn split_digests(state: &TrainState) -> Result<(u64, u64), StateError> {
    let mut rest = Xxh3::new();
    for (name, t) in &state.model.buffers {
        crate::state::host::stream_bytes(name, t, &mut |b| rest.update(b))?;
    }
    rest.update(&serde_json::to_vec(state.position()).expect("plain data"));
    Ok((crate::train::sharded_step::params_digest(&state.model.params), rest.digest()))
}

/// Where two copies of a sharded optimizer's range differ (per member, per range: its copy's
/// digest): why, naming the first such range and its holders, and the holders' names. `when`:
/// the replica check at a step, or a generation forming.
pub(crate) fn ranges_differ(session: &Session, when: &str, held: &[Vec<Option<u64>>]) -> Option<(String, Vec<String>)> {
    let ranges = held.first().map_or(0, Vec::len);
    let differing: Vec<usize> = (0..ranges)
        .filter(|&r| {
            let copies: Vec<u64> = held.iter().filter_map(|h| h[r]).collect();
            copies.iter().any(|&d| d != copies[0])
        })
        .collect();
    let &r = differing.first()?;
    let holders: Vec<(String, u64)> =
        held.iter().enumerate().filter_map(|(p, h)| h[r].map(|d| (session.name_at(p), d))).collect();
    let names: Vec<String> = holders.iter().map(|(n, _)| n.clone()).collect();
    let found: Vec<String> = holders.iter().map(|(n, d)| format!("{d:016x} on {n}")).collect();
    let why = format!(
        "{when}: {} range(s) of the sharded optimizer state differ between their two copies \
         (range {r}: xxh3 {}); with two copies neither is known right, and every member goes back to the last commit",
        differing.len(),
        found.join(" against ")
    );
    Some((why, names))
}

/// A state's xxh3-64 (of its encoding), hashed as it is written, without a copy: a state found
/// equal is encoded to be kept only once the comparison has said so, after the last agreed one
/// is dropped, so that a worker never holds two encoded copies of its state.
pub(super) fn digest(state: &TrainState) -> Result<u64, StateError> {
    let mut hasher = Xxh3::new();
    state.encoding()?.write(&mut |b| hasher.update(b))?;
    Ok(hasher.digest())
}
