//! A formation received from the coordinator, checked before this member follows it: every rank
//! it names is one of the cluster's, the members are in ring order and include this member, and
//! the source, the coordinator and the receivers are members. The training loop indexes its
//! names, slots and ranges by these ranks; a formation that breaks them (another version's
//! coordinator, or a bug) is refused naming what is wrong, never followed into a panic.

use super::super::wire::Formed;

/// What is wrong with `formed` for member `me` of a cluster of `world`, if anything.
pub(super) fn wrong(formed: &Formed, world: usize, me: usize) -> Option<String> {
    let members = &formed.members;
    if let Some(&r) = members.iter().find(|&&r| r >= world) {
        return Some(format!("member rank {r} is not one of the cluster's {world}"));
    }
    if members.windows(2).any(|w| w[0] >= w[1]) {
        return Some(format!("its members {members:?} are not in ascending rank order"));
    }
    if !members.contains(&me) {
        return Some(format!("its members {members:?} do not include this worker (rank {me})"));
    }
    let named = [("source", formed.source), ("coordinator", formed.coordinator)];
    let receivers = formed.receivers.iter().map(|&r| ("receiver", r));
    if let Some((what, r)) = named.into_iter().chain(receivers).find(|&(_, r)| !members.contains(&r)) {
        return Some(format!("its {what}, rank {r}, is not one of its members {members:?}"));
    }
    (formed.data_addresses.len() != world)
        .then(|| format!("it gives {} data-plane address(es) for {world} workers", formed.data_addresses.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn formed(members: Vec<usize>, source: usize, receivers: Vec<usize>) -> Formed {
        let data_addresses = (0..3).map(|r| format!("127.0.0.1:{}", 7000 + r)).collect();
        Formed { members, source, receivers, data_addresses, ..Formed::alone(4, (10, 0)) }
    }

    #[test]
    fn a_formation_naming_ranks_outside_its_members_is_refused_naming_them() {
        assert_eq!(wrong(&formed(vec![0, 1, 2], 1, vec![0, 2]), 3, 2), None);
        let said = |f: Formed| wrong(&f, 3, 1).unwrap();
        assert_eq!(said(formed(vec![0, 1, 5], 0, vec![])), "member rank 5 is not one of the cluster's 3");
        assert_eq!(said(formed(vec![1, 0], 0, vec![])), "its members [1, 0] are not in ascending rank order");
        assert_eq!(said(formed(vec![0, 2], 0, vec![])), "its members [0, 2] do not include this worker (rank 1)");
        assert_eq!(said(formed(vec![0, 1], 2, vec![])), "its source, rank 2, is not one of its members [0, 1]");
        assert_eq!(said(formed(vec![0, 1], 0, vec![7])), "its receiver, rank 7, is not one of its members [0, 1]");
        let mut f = formed(vec![0, 1], 0, vec![]);
        f.coordinator = 2;
        assert_eq!(said(f), "its coordinator, rank 2, is not one of its members [0, 1]");
        let f = Formed { data_addresses: vec![], ..formed(vec![0, 1], 0, vec![]) };
        assert_eq!(said(f), "it gives 0 data-plane address(es) for 3 workers");
    }
}
