//! The host tier below an executor's device budget: which experts it holds at start, and what
//! happens to an expert leaving the device budget.
//!
//! An expert evicted from the device budget is *demoted* to the host tier when it fits, making
//! room by evicting (to disk) host-resident experts of strictly lower usage probability, lowest
//! first; when even that does not make room (or it is larger than the host budget), it is dropped
//! to disk instead. Usage probability is the one the model pre-assesses (the chance a request
//! uses the expert), so a hot expert is never pushed out by a colder one. Ties keep the expert
//! already there (no churn), and every ordering breaks ties by expert id: the decisions are
//! deterministic.

use std::collections::BTreeMap;

use super::model::{CoeModel, ExpertId, Tier};

/// An expert as the host tier sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostCandidate {
    /// The expert.
    pub id: ExpertId,
    /// Bytes it occupies in the host tier.
    pub size_bytes: u64,
    /// Its usage probability (ranks who stays).
    pub usage_prob: f64,
}

/// What to do with an expert leaving the device budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Demotion {
    /// Evict these host-resident experts to disk (in this order), then keep the expert in the
    /// host tier.
    ToHost {
        /// Host-resident experts to drop first (possibly none).
        evict: Vec<ExpertId>,
    },
    /// Drop it to disk; the host tier is unchanged.
    Drop,
}

/// Decide where `leaving` goes, given what the host tier holds (`resident`), its `budget` and
/// the bytes in use (`used`). See the module docs for the rule.
pub fn plan_demotion(
    leaving: &HostCandidate,
    resident: &[HostCandidate],
    budget: u64,
    used: u64,
) -> Demotion {
    if leaving.size_bytes > budget {
        return Demotion::Drop;
    }
    let mut free = budget.saturating_sub(used);
    if leaving.size_bytes <= free {
        return Demotion::ToHost { evict: Vec::new() };
    }
    let mut colder: Vec<&HostCandidate> =
        resident.iter().filter(|r| r.id != leaving.id && r.usage_prob < leaving.usage_prob).collect();
    colder.sort_by(|a, b| a.usage_prob.total_cmp(&b.usage_prob).then(a.id.cmp(&b.id)));
    let mut evict = Vec::new();
    for r in colder {
        evict.push(r.id);
        free = free.saturating_add(r.size_bytes);
        if leaving.size_bytes <= free {
            return Demotion::ToHost { evict };
        }
    }
    Demotion::Drop
}

/// The experts the host tier is filled with at start: `candidates` by descending usage
/// probability (ties by id), each taken while it still fits in `budget`.
pub fn initial_host_set(candidates: &[HostCandidate], budget: u64) -> Vec<ExpertId> {
    let mut order: Vec<&HostCandidate> = candidates.iter().collect();
    order.sort_by(|a, b| b.usage_prob.total_cmp(&a.usage_prob).then(a.id.cmp(&b.id)));
    let mut used = 0u64;
    let mut out = Vec::new();
    for c in order {
        if let Some(total) = used.checked_add(c.size_bytes)
            && total <= budget
        {
            used = total;
            out.push(c.id);
        }
    }
    out
}

/// One executor's host tier as the scheduler tracks it: filled like the executor's at start
/// ([`initial_host_set`] over the host-homed experts) and moved by the same two rules (a load
/// promotes an expert out of it, a device eviction is placed by [`plan_demotion`]), so that a
/// load is planned from the tier the expert is in now, not from its home.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTier {
    budget: u64,
    used: u64,
    /// Host-resident experts: size and usage probability.
    resident: BTreeMap<ExpertId, (u64, f64)>,
}

impl HostTier {
    /// The host budget an executor gets when none is given: the host-homed experts' bytes.
    pub fn default_budget(model: &CoeModel) -> u64 {
        model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum()
    }

    /// The host tier of an executor of `model` with `budget` bytes, as it is at start.
    pub fn new(model: &CoeModel, budget: u64) -> HostTier {
        let homed: Vec<HostCandidate> = model
            .experts()
            .iter()
            .filter(|e| e.home == Tier::Host)
            .map(|e| HostCandidate { id: e.id, size_bytes: e.size_bytes, usage_prob: e.usage_prob })
            .collect();
        let mut tier = HostTier { budget, used: 0, resident: BTreeMap::new() };
        for id in initial_host_set(&homed, budget) {
            if let Some(c) = homed.iter().find(|c| c.id == id) {
                tier.insert(c);
            }
        }
        tier
    }

    /// The host tier holding exactly `resident` (as an executor reports it), checked: every
    /// expert known, none twice, their bytes within `budget`.
    pub fn from_resident(model: &CoeModel, budget: u64, resident: &[ExpertId]) -> Result<HostTier, String> {
        let mut tier = HostTier { budget, used: 0, resident: BTreeMap::new() };
        for &id in resident {
            let e = model.expert(id).ok_or_else(|| format!("{id} is not in the model"))?;
            if tier.resident.contains_key(&id) {
                return Err(format!("{id} named twice"));
            }
            tier.insert(&HostCandidate { id, size_bytes: e.size_bytes, usage_prob: e.usage_prob });
        }
        if tier.used > budget {
            return Err(format!("{} bytes in a host budget of {budget}", tier.used));
        }
        Ok(tier)
    }

    fn insert(&mut self, c: &HostCandidate) {
        if self.resident.insert(c.id, (c.size_bytes, c.usage_prob)).is_none() {
            self.used = self.used.saturating_add(c.size_bytes);
        }
    }

    fn remove(&mut self, id: ExpertId) -> bool {
        match self.resident.remove(&id) {
            Some((size, _)) => {
                self.used = self.used.saturating_sub(size);
                true
            }
            None => false,
        }
    }

    /// The tier a load of `expert` comes from now.
    pub fn source_of(&self, expert: ExpertId) -> Tier {
        if self.resident.contains_key(&expert) { Tier::Host } else { Tier::Ssd }
    }

    /// `expert` is loaded onto the device: its host copy (if any) is released. True when it
    /// was a promotion from this tier.
    pub fn promote(&mut self, expert: ExpertId) -> bool {
        self.remove(expert)
    }

    /// `leaving` leaves the device budget: placed by [`plan_demotion`] (colder host experts
    /// evicted to disk first when needed). Returns the decision carried out.
    pub fn demote(&mut self, leaving: &HostCandidate) -> Demotion {
        let resident: Vec<HostCandidate> = self
            .resident
            .iter()
            .map(|(&id, &(size_bytes, usage_prob))| HostCandidate { id, size_bytes, usage_prob })
            .collect();
        let plan = plan_demotion(leaving, &resident, self.budget, self.used);
        if let Demotion::ToHost { evict } = &plan {
            for victim in evict {
                self.remove(*victim);
            }
            self.insert(leaving);
        }
        plan
    }

    /// Experts in the tier, by id.
    pub fn resident(&self) -> Vec<ExpertId> {
        self.resident.keys().copied().collect()
    }

    /// Bytes in the tier.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The tier's budget, bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(id: u32, size_bytes: u64, usage_prob: f64) -> HostCandidate {
        HostCandidate { id: ExpertId(id), size_bytes, usage_prob }
    }

    #[test]
    fn demotion_fits_evicts_colder_or_drops() {
        let resident = [c(1, 40, 0.1), c(2, 30, 0.05), c(3, 30, 0.9)];
        // 100 budget, 100 used: the 50-byte expert at 0.5 pushes out 2 (0.05) then 1 (0.1).
        assert_eq!(
            plan_demotion(&c(9, 50, 0.5), &resident, 100, 100),
            Demotion::ToHost { evict: vec![ExpertId(2), ExpertId(1)] }
        );
        // Room already: nothing evicted.
        assert_eq!(plan_demotion(&c(9, 50, 0.5), &resident, 200, 100), Demotion::ToHost { evict: vec![] });
        // Colder than all but expert 2: evicting 2 alone frees 30 < 50, so it is dropped.
        assert_eq!(plan_demotion(&c(9, 50, 0.07), &resident, 100, 100), Demotion::Drop);
        // Equal probability never displaces (no churn), larger than the budget never enters.
        assert_eq!(plan_demotion(&c(9, 30, 0.05), &[c(2, 30, 0.05)], 30, 30), Demotion::Drop);
        assert_eq!(plan_demotion(&c(9, 101, 1.0), &[], 100, 0), Demotion::Drop);
    }

    #[test]
    fn initial_set_takes_the_most_used_that_fit() {
        let cands = [c(0, 60, 0.2), c(1, 50, 0.9), c(2, 40, 0.5), c(3, 10, 0.1)];
        assert_eq!(initial_host_set(&cands, 100), vec![ExpertId(1), ExpertId(2), ExpertId(3)]);
        assert_eq!(initial_host_set(&cands, 0), Vec::<ExpertId>::new());
    }

    proptest! {
        /// After a planned demotion the host tier is within budget and holds only experts at
        /// least as likely to be used as any it evicted for it.
        #[test]
        fn demotion_keeps_the_budget(sizes in proptest::collection::vec((1u64..100, 0u32..100), 0..12),
                                     leaving in (1u64..150, 0u32..100), budget in 0u64..400) {
            let cands: Vec<HostCandidate> =
                sizes.iter().enumerate().map(|(i, (s, p))| c(i as u32, *s, f64::from(*p) / 100.0)).collect();
            let resident: Vec<HostCandidate> = initial_host_set(&cands, budget)
                .into_iter().map(|id| cands[id.index()]).collect();
            let used: u64 = resident.iter().map(|r| r.size_bytes).sum();
            prop_assert!(used <= budget);
            let l = c(99, leaving.0, f64::from(leaving.1) / 100.0);
            match plan_demotion(&l, &resident, budget, used) {
                Demotion::ToHost { evict } => {
                    let freed: u64 = evict.iter().map(|e| cands[e.index()].size_bytes).sum();
                    prop_assert!(used - freed + l.size_bytes <= budget);
                    for e in &evict {
                        prop_assert!(cands[e.index()].usage_prob < l.usage_prob);
                    }
                }
                Demotion::Drop => {
                    let colder: u64 = resident.iter().filter(|r| r.usage_prob < l.usage_prob).map(|r| r.size_bytes).sum();
                    prop_assert!(used - colder + l.size_bytes > budget, "dropped although evicting colder ones makes room");
                }
            }
        }
    }
}
