//! Virtual ranks ("slots"): the run's math belongs to V slots (every training task of
//! TF_CONFIG), never to the physical workers present. Slot s owns its slice of the global batch,
//! its dropout seed, its copy of the buffers, its gradient, its evaluation shard and its place in
//! the reduction; which worker computes it is a pure function of (V, the workers present)
//! ([`assign`]), so a run on fewer workers is bit for bit the run on V.

use std::ops::Range;

/// The slots of a run, and the ones this worker holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slots {
    /// V: slots in the run.
    pub(crate) count: usize,
    /// The slots this worker holds (contiguous, in ring order).
    pub(crate) held: Range<usize>,
}

impl Slots {
    /// A run of one slot, held here.
    pub(crate) fn single() -> Slots {
        Slots { count: 1, held: 0..1 }
    }

    /// Slot `rank` of `count`: a worker in a full cluster.
    pub(crate) fn one(rank: usize, count: usize) -> Slots {
        Slots { count, held: rank..rank + 1 }
    }

    /// How many slots this worker holds.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }
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

/// Which present worker (its index in `present`) holds `slot`.
pub(crate) fn holder(count: usize, present: &[usize], slot: usize) -> usize {
    assign(count, present).iter().position(|r| r.contains(&slot)).expect("every slot is held")
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
        assert_eq!(holder(4, &[0, 3], 2), 1);
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
