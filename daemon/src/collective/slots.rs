//! Virtual ranks ("slots"): the run's math belongs to V slots (every training task of
//! TF_CONFIG), never to the physical workers present. Slot s owns its slice of the global batch,
//! its dropout seed, its copy of the buffers, its gradient, its evaluation shard and its place in
//! the reduction; which worker computes it is a pure function of (V, the workers present)
//! ([`assign`], or [`assign_home`] where moving a slot moves state), so a run on fewer workers is
//! bit for bit the run on V.

use std::ops::Range;

/// The slots of a run, and the ones this worker holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slots {
    /// V: slots in the run.
    pub(crate) count: usize,
    /// The slots this worker holds (contiguous in ring order). Under [`assign_home`] they may
    /// wrap past the last slot: `end` up to `start + count`, slot `u % count`; iterate them with
    /// [`Slots::iter`].
    pub(crate) held: Range<usize>,
    /// Every worker's slots, by place in the ring (`layout[place] == held`).
    pub(crate) layout: Vec<Range<usize>>,
    /// This worker's place in the ring.
    pub(crate) place: usize,
}

impl Slots {
    /// A run of one slot, held here.
    pub(crate) fn single() -> Slots {
        Slots::all(1)
    }

    /// A worker alone holding all `count` slots.
    pub(crate) fn all(count: usize) -> Slots {
        Slots::of(count, std::iter::once(0..count).collect(), 0)
    }

    /// Slot `rank` of `count`: a worker in a full cluster.
    pub(crate) fn one(rank: usize, count: usize) -> Slots {
        Slots::of(count, (0..count).map(|r| r..r + 1).collect(), rank)
    }

    /// The worker at `place` of a ring whose workers hold `layout`.
    pub(crate) fn of(count: usize, layout: Vec<Range<usize>>, place: usize) -> Slots {
        Slots { count, held: layout[place].clone(), layout, place }
    }

    /// How many slots this worker holds.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// The slots this worker holds, in ring order (`0..count`).
    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.held.clone().map(|u| u % self.count)
    }

    /// Whether this worker holds slot `s`.
    pub(crate) fn holds(&self, s: usize) -> bool {
        self.index(s).is_some()
    }

    /// Where slot `s` is among the slots held here (its buffer's index), if held.
    pub(crate) fn index(&self, s: usize) -> Option<usize> {
        index_in(self.count, &self.held, s)
    }

    /// The slots of the previous worker in ring order (this worker's own when alone).
    pub(crate) fn before(&self) -> Slots {
        let w = self.layout.len();
        Slots::of(self.count, self.layout.clone(), (self.place + w - 1) % w)
    }

    /// The place in the ring of the worker holding slot `s`.
    pub(crate) fn holder_place(&self, s: usize) -> usize {
        self.layout.iter().position(|held| index_in(self.count, held, s).is_some()).expect("every slot is held")
    }
}

/// Where slot `s` is among `held` (of `count`, possibly wrapping past the last slot), if there.
fn index_in(count: usize, held: &Range<usize>, s: usize) -> Option<usize> {
    let i = (s % count + count - held.start % count) % count;
    (i < held.len()).then_some(i)
}

/// `held` as people read it: `slot 3`, `slots 0-1`, or wrapping past the last slot
/// `slots 5, 0-1`.
pub(crate) fn describe(count: usize, held: &Range<usize>) -> String {
    let span = |r: Range<usize>| match r.len() {
        1 => format!("{}", r.start),
        _ => format!("{}-{}", r.start, r.end - 1),
    };
    let word = if held.len() == 1 { "slot" } else { "slots" };
    if held.end <= count {
        return format!("{word} {}", span(held.clone()));
    }
    format!("{word} {}, {}", span(held.start..count), span(0..held.end - count))
}

/// The slots each present worker holds, in the order of `present` (the task ranks present,
/// ascending, which is the ring's order): contiguous, balanced ranges covering `0..count`, the
/// larger ones first. With every rank present, rank r holds slot r.
pub(crate) fn assign(count: usize, present: &[usize]) -> Vec<Range<usize>> {
    let w = present.len();
    if w == 0 {
        return Vec::new();
    }
    let (base, extra) = (count / w, count % w);
    let mut start = 0;
    (0..w)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// The slots each present worker holds where moving a slot moves state (a sharded optimizer's
/// ranges follow the slots that finish them): every present rank keeps its own slots (rank r's
/// of `count = world * k` are `r*k..(r+1)*k`), and the slots of a run of absent ranks between two
/// present ones (in ring order, cyclically) are split between them, the first half (rounded up)
/// to the one before. So a worker lost or back moves only its own slots, from or to its two
/// neighbours in the ring, and every worker holds one contiguous range in ring order (the first
/// or the last may wrap past slot `count - 1`: see [`Slots::held`]). In the order of `present`
/// (ascending, the ring's order).
pub(crate) fn assign_home(count: usize, world: usize, present: &[usize]) -> Vec<Range<usize>> {
    let w = present.len();
    if w <= 1 || world == 0 || !count.is_multiple_of(world) {
        return assign(count, present);
    }
    let k = count / world;
    // Slots in the run of absent ranks after each present one, cyclically.
    let after: Vec<usize> = (0..w).map(|i| ((present[(i + 1) % w] + world - present[i] - 1) % world) * k).collect();
    (0..w)
        .map(|i| {
            let before = after[(i + w - 1) % w];
            let start = (present[i] * k + count - before / 2) % count;
            let len = k + before / 2 + after[i].div_ceil(2);
            start..start + len
        })
        .collect()
}

/// Per slot of a run of `count` slots, whether the rank that holds it with all `world` ranks
/// present is one of `ranks`: how a rank's flag travels in a step's per-slot tail.
pub(crate) fn of_ranks(count: usize, world: usize, ranks: &[usize]) -> Vec<bool> {
    let all: Vec<usize> = (0..world).collect();
    let mut flags = vec![false; count];
    for (rank, held) in assign(count, &all).into_iter().enumerate() {
        if ranks.contains(&rank) {
            flags[held].fill(true);
        }
    }
    flags
}

/// The ranks (of `world`, all present) that hold any of `slots`, ascending: [`of_ranks`] read back.
pub(crate) fn ranks_of(count: usize, world: usize, slots: &[usize]) -> Vec<usize> {
    let all: Vec<usize> = (0..world).collect();
    let held = assign(count, &all);
    (0..world).filter(|&r| slots.iter().any(|s| held[r].contains(s))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_full_cluster_holds_one_slot_each() {
        assert_eq!(assign(3, &[0, 1, 2]), vec![0..1, 1..2, 2..3]);
        assert_eq!(assign(1, &[0]), vec![0..1]);
    }

    #[test]
    fn missing_workers_slots_are_spread_over_the_survivors() {
        assert_eq!(assign(3, &[0, 1]), vec![0..2, 2..3]);
        assert_eq!(assign(3, &[1, 2]), vec![0..2, 2..3]);
        assert_eq!(assign(4, &[0, 3]), vec![0..2, 2..4]);
        assert_eq!(assign(5, &[0, 2, 4]), vec![0..2, 2..4, 4..5]);
    }

    #[test]
    fn home_slots_stay_and_a_lost_workers_go_to_its_neighbours() {
        assert_eq!(assign_home(4, 4, &[0, 1, 2, 3]), vec![0..1, 1..2, 2..3, 3..4]);
        // Worker 1 lost: its slot goes to worker 0 (the one before); nobody else's moves.
        assert_eq!(assign_home(4, 4, &[0, 2, 3]), vec![0..2, 2..3, 3..4]);
        // Worker 0 lost: its slot goes to worker 3, the one before it in the ring (wrapping).
        assert_eq!(assign_home(4, 4, &[1, 2, 3]), vec![1..2, 2..3, 3..5]);
        // Two of four: each keeps its own and takes one of the others'.
        assert_eq!(assign_home(4, 4, &[0, 1]), vec![3..5, 1..3]);
        // Two slots each (V = 6 on 3 workers), worker 0 lost: one slot to each neighbour.
        assert_eq!(assign_home(6, 3, &[1, 2]), vec![1..4, 4..7]);
        let slots = Slots::of(6, assign_home(6, 3, &[1, 2]), 1);
        assert_eq!(slots.iter().collect::<Vec<_>>(), vec![4, 5, 0]);
        assert_eq!((slots.index(0), slots.index(4), slots.index(1)), (Some(2), Some(0), None));
        assert_eq!((slots.before().held, slots.holder_place(0), slots.holder_place(3)), (1..4, 1, 0));
        assert_eq!(describe(6, &(4..7)), "slots 4-5, 0");
        assert_eq!(describe(6, &(5..7)), "slots 5, 0");
        assert_eq!(describe(6, &(1..2)), "slot 1");
    }

    proptest! {
        /// Whoever is present, every slot is held exactly once, in order, and no worker holds
        /// more than one slot more than another.
        #[test]
        fn every_slot_is_held_exactly_once(count in 1usize..12, mask in 1u32..4096) {
            let present: Vec<usize> = (0..count).filter(|r| mask & (1 << r) != 0).collect();
            prop_assume!(!present.is_empty());
            let ranges = assign(count, &present);
            prop_assert_eq!(ranges.len(), present.len());
            let flat: Vec<usize> = ranges.iter().flat_map(Clone::clone).collect();
            prop_assert_eq!(flat, (0..count).collect::<Vec<_>>());
            let (min, max) = (ranges.iter().map(|r| r.len()).min().unwrap(), ranges.iter().map(|r| r.len()).max().unwrap());
            prop_assert!(min >= 1 && max - min <= 1);
        }

        /// Home slots: every slot held exactly once, each worker's contiguous in ring order and
        /// its own among them; and a worker lost (or back) moves only its own slots.
        #[test]
        fn home_slots_move_only_the_lost_workers(world in 1usize..9, k in 1usize..4, mask in 1u32..256, lost in 0usize..8) {
            let count = world * k;
            let present: Vec<usize> = (0..world).filter(|r| mask & (1 << r) != 0).collect();
            prop_assume!(!present.is_empty());
            let ranges = assign_home(count, world, &present);
            let holder = |ranges: &[Range<usize>], present: &[usize]| {
                let mut by_slot = vec![usize::MAX; count];
                for (i, r) in ranges.iter().enumerate() {
                    prop_assert!(r.start < count && r.len() <= count);
                    for u in r.clone() {
                        prop_assert_eq!(by_slot[u % count], usize::MAX, "slot {} held twice", u % count);
                        by_slot[u % count] = present[i];
                    }
                }
                Ok(by_slot)
            };
            let by_slot = holder(&ranges, &present)?;
            prop_assert!(by_slot.iter().all(|&h| h != usize::MAX));
            for (i, &r) in present.iter().enumerate() {
                prop_assert!((r * k..(r + 1) * k).all(|s| by_slot[s] == r), "rank {} keeps its own", r);
                prop_assert_eq!(ranges[(i + 1) % present.len()].start, ranges[i].end % count);
            }
            let lost = present[lost % present.len()];
            let after: Vec<usize> = present.iter().copied().filter(|&r| r != lost).collect();
            prop_assume!(!after.is_empty());
            let moved = holder(&assign_home(count, world, &after), &after)?;
            for s in 0..count {
                prop_assert!(by_slot[s] == lost || moved[s] == by_slot[s], "slot {} moved from {}", s, by_slot[s]);
            }
        }

        /// The ranks a step's tail carries (as flags per slot) read back as the same ranks.
        #[test]
        fn ranks_flagged_per_slot_read_back_as_themselves(world in 1usize..8, extra in 0usize..8, mask in 0u32..256) {
            let count = world + extra;
            let ranks: Vec<usize> = (0..world).filter(|r| mask & (1 << r) != 0).collect();
            let flags = of_ranks(count, world, &ranks);
            prop_assert_eq!(flags.len(), count);
            let slots: Vec<usize> = (0..count).filter(|&s| flags[s]).collect();
            prop_assert_eq!(ranks_of(count, world, &slots), ranks);
        }
    }
}
