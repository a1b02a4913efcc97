//! Where a supervisor places a child on another node: among the members whose certificate
//! roles the child's kind needs and that declare room for it, the one with the most free
//! slots, then the fewest hosted, then by name (deterministic: the same view gives the same
//! choice). Nodes the caller excludes (the one that just went down) are never chosen.

/// What the supervisor knows of one candidate node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate<K> {
    /// The node.
    pub node: K,
    /// Whether its certificate has a role the child's kind needs and its config lets this
    /// supervisor place the kind there.
    pub eligible: bool,
    /// Children it declares it can host in all.
    pub capacity: u32,
    /// Children it hosts now.
    pub hosted: u32,
}

impl<K> Candidate<K> {
    /// Slots left.
    pub fn free(&self) -> u32 {
        self.capacity.saturating_sub(self.hosted)
    }
}

/// Why no node was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoPlacement {
    /// No candidate is eligible (role or config).
    NoEligibleNode,
    /// Eligible nodes exist, but all are full.
    AllFull,
}

/// The node to place one child on: see the module doc.
pub fn choose<'a, K: Ord>(candidates: &'a [Candidate<K>], exclude: &[K]) -> Result<&'a K, NoPlacement> {
    let eligible: Vec<&Candidate<K>> =
        candidates.iter().filter(|c| c.eligible && !exclude.contains(&c.node)).collect();
    if eligible.is_empty() {
        return Err(NoPlacement::NoEligibleNode);
    }
    eligible
        .into_iter()
        .filter(|c| c.free() > 0)
        .max_by(|a, b| a.free().cmp(&b.free()).then(b.hosted.cmp(&a.hosted)).then(b.node.cmp(&a.node)))
        .map(|c| &c.node)
        .ok_or(NoPlacement::AllFull)
}

/// The generation of a supervisor's next placement: its node's wall clock in microseconds
/// (numbers that grow across processes and restarts), but always past `last`, the highest it
/// used, so a wall clock stepped back (NTP, a skewed clock) never gives a later placement a
/// lower generation, which a name would resolve past and a node would refuse as older.
pub fn next_generation(last: u64, wall: u64) -> u64 {
    wall.max(last.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(node: &str, eligible: bool, capacity: u32, hosted: u32) -> Candidate<String> {
        Candidate { node: node.into(), eligible, capacity, hosted }
    }

    #[test]
    fn the_freest_eligible_node_wins_and_ties_go_by_name() {
        let v = [c("a", true, 2, 1), c("b", true, 4, 1), c("c", false, 9, 0), c("d", true, 4, 1)];
        assert_eq!(choose(&v, &[]), Ok(&"b".to_string()));
        assert_eq!(choose(&v, &["b".to_string()]), Ok(&"d".to_string()));
    }

    #[test]
    fn refusals_say_whether_no_node_may_host_or_all_are_full() {
        let v = [c("a", true, 1, 1), c("c", false, 9, 0)];
        assert_eq!(choose(&v, &[]), Err(NoPlacement::AllFull));
        assert_eq!(choose(&v, &["a".to_string()]), Err(NoPlacement::NoEligibleNode));
        assert_eq!(choose::<String>(&[], &[]), Err(NoPlacement::NoEligibleNode));
    }

    #[test]
    fn generations_grow_even_when_the_wall_clock_steps_back() {
        assert_eq!(next_generation(0, 1_000), 1_000);
        assert_eq!(next_generation(1_000, 2_000), 2_000);
        // the clock stepped back by a second: still past the last one
        assert_eq!(next_generation(2_000_000, 1_000_000), 2_000_001);
        assert_eq!(next_generation(5, 5), 6);
        assert_eq!(next_generation(u64::MAX, 7), u64::MAX);
    }
}
