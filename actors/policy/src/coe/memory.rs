//! Expert residency on one executor under a byte budget, and which experts to evict.
//!
//! [`ExpertManager`] tracks what is resident, how many batches pin each expert (a pinned expert is
//! loading or executing and is never evicted), and picks eviction victims by one of three
//! policies ([`EvictionPolicy`]):
//!
//! - **Two-stage** (CoServe's dependency-aware management, as the paper describes it): stage 1
//!   evicts subsequent experts whose preliminary expert is not resident (they cannot run soon);
//!   stage 2 evicts the rest in ascending usage probability. Queue hints are ignored.
//! - **Two-stage with lookahead** (ours): the same two stages, except that experts queued work
//!   still needs ([`EvictionContext::next_use`]) are kept until last and then evicted
//!   farthest-next-use first, within stage 2 an expert another executor also holds
//!   ([`EvictionContext::resident_elsewhere`]) goes before a sole copy, and within each stage
//!   the lowest usage probability *per byte* goes first: what is counted is loads, and one
//!   large, rarely used expert frees the room of several small ones (the density order of the
//!   knapsack that maximises the chance a request finds its expert resident). Without hints,
//!   with one executor and with experts of one size it decides exactly as the plain two stages.
//! - **LRU** (the Samba-CoE baseline): least recently used first; stages and hints are ignored.
//!
//! Every policy takes victims in its order until the expert fits, then spares those the later,
//! larger ones made unnecessary (a small victim taken before one that alone makes room).
//!
//! [`belady_min_loads`] replays a served order under Belady's MIN, the yardstick for load counts.

use std::collections::BTreeMap;

use super::model::{CoeModel, ExpertId};

/// How victims are chosen when room is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// The paper's dependency-aware two-stage eviction alone: stranded subsequent experts first,
    /// then ascending usage probability. Ignores what queued work needs.
    TwoStage,
    /// Two-stage eviction that also looks ahead in the queue: experts queued work needs are kept
    /// to the last, farthest next use first among them; copies another executor also holds go
    /// before sole copies; within a stage, lowest usage probability per byte first (ours).
    TwoStageLookahead,
    /// Least recently used (baseline).
    Lru,
}

impl EvictionPolicy {
    /// Every policy, in the order error messages list them.
    pub const ALL: [EvictionPolicy; 3] =
        [EvictionPolicy::TwoStage, EvictionPolicy::TwoStageLookahead, EvictionPolicy::Lru];

    /// Short name for reports, golden files and the command line.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::TwoStage => "two-stage",
            EvictionPolicy::TwoStageLookahead => "two-stage+lookahead",
            EvictionPolicy::Lru => "lru",
        }
    }

    /// Whether victims are ranked with the queue's hints ([`EvictionContext::next_use`]); the
    /// scheduler skips computing them otherwise.
    pub fn uses_queue_hints(self) -> bool {
        self == EvictionPolicy::TwoStageLookahead
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not an [`EvictionPolicy`]; the message lists the valid ones.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown eviction policy {0:?} (use two-stage, two-stage+lookahead or lru)")]
pub struct UnknownEvictionPolicy(pub String);

impl std::str::FromStr for EvictionPolicy {
    type Err = UnknownEvictionPolicy;

    /// Parses a [`EvictionPolicy::name`] exactly.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EvictionPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownEvictionPolicy(s.to_string()))
    }
}

/// Why a residency operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The expert alone is bigger than the whole budget; it can never be resident here.
    #[error("{expert} needs {size} bytes but the budget is only {budget} bytes")]
    TooLarge {
        /// The expert.
        expert: ExpertId,
        /// Its size.
        size: u64,
        /// The budget.
        budget: u64,
    },
    /// Not enough unpinned bytes can be freed right now; the caller must wait for a batch to end.
    #[error("{expert} needs {size} bytes; only {free} are free and pinned experts hold the rest")]
    NoRoom {
        /// The expert.
        expert: ExpertId,
        /// Its size.
        size: u64,
        /// Bytes free now.
        free: u64,
    },
    /// The expert is already resident.
    #[error("{0} is already resident")]
    AlreadyResident(ExpertId),
    /// The expert is not resident.
    #[error("{0} is not resident")]
    NotResident(ExpertId),
    /// The expert is pinned (loading or executing) and may not be evicted.
    #[error("{0} is pinned by a running batch and may not be evicted")]
    Pinned(ExpertId),
    /// Unpin without a matching pin.
    #[error("{0} is not pinned")]
    NotPinned(ExpertId),
}

/// What the two-stage policies may consult when ranking victims.
pub struct EvictionContext<'a> {
    /// The application model (kinds, preliminaries, usage probabilities).
    pub model: &'a CoeModel,
    /// Whether an expert is resident (anywhere the caller considers close enough to run soon).
    pub is_resident: &'a dyn Fn(ExpertId) -> bool,
    /// Whether an expert is also resident on another executor, which can serve it without a
    /// load. Only [`EvictionPolicy::TwoStageLookahead`] consults it.
    pub resident_elsewhere: &'a dyn Fn(ExpertId) -> bool,
    /// Position of an expert's next queued use (smaller = sooner), `None` when no queued work
    /// needs it. Only [`EvictionPolicy::TwoStageLookahead`] consults it.
    pub next_use: &'a dyn Fn(ExpertId) -> Option<u64>,
}

#[derive(Clone, Debug)]
struct Slot {
    size: u64,
    pins: u32,
    last_use: u64,
}

/// Residency of experts on one executor under a byte budget.
#[derive(Clone, Debug)]
pub struct ExpertManager {
    policy: EvictionPolicy,
    budget: u64,
    used: u64,
    slots: BTreeMap<ExpertId, Slot>,
    tick: u64,
}

impl ExpertManager {
    /// An empty manager holding at most `budget` bytes of experts.
    pub fn new(budget: u64, policy: EvictionPolicy) -> Self {
        ExpertManager { policy, budget, used: 0, slots: BTreeMap::new(), tick: 0 }
    }

    /// The eviction policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes held by resident experts (never above the budget).
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Bytes still free.
    pub fn free_bytes(&self) -> u64 {
        self.budget - self.used
    }

    /// Whether `expert` is resident.
    pub fn is_resident(&self, expert: ExpertId) -> bool {
        self.slots.contains_key(&expert)
    }

    /// Whether `expert` is resident and pinned.
    pub fn is_pinned(&self, expert: ExpertId) -> bool {
        self.slots.get(&expert).is_some_and(|s| s.pins > 0)
    }

    /// Resident experts in id order.
    pub fn resident(&self) -> impl Iterator<Item = ExpertId> + '_ {
        self.slots.keys().copied()
    }

    /// Victims to evict, in order, so that an expert of `size` bytes fits; empty when it fits
    /// already. Changes nothing. Errors: [`MemoryError::TooLarge`] if it can never fit,
    /// [`MemoryError::NoRoom`] if pinned experts hold too much right now.
    pub fn plan_eviction(
        &self,
        expert: ExpertId,
        size: u64,
        ctx: &EvictionContext<'_>,
    ) -> Result<Vec<ExpertId>, MemoryError> {
        if size > self.budget {
            return Err(MemoryError::TooLarge { expert, size, budget: self.budget });
        }
        if self.slots.contains_key(&expert) {
            return Err(MemoryError::AlreadyResident(expert));
        }
        let mut free = self.free_bytes();
        if free >= size {
            return Ok(Vec::new());
        }
        let mut candidates: Vec<(VictimKey, ExpertId, u64)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.pins == 0)
            .map(|(&id, s)| (self.victim_key(id, s, ctx), id, s.size))
            .collect();
        candidates.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut victims = Vec::new();
        for (_, id, victim_size) in candidates {
            if free >= size {
                break;
            }
            victims.push((id, victim_size));
            free += victim_size;
        }
        if free < size {
            return Err(MemoryError::NoRoom { expert, size, free: self.free_bytes() });
        }
        // The greedy pass may have taken a small victim before a large one that alone makes
        // room: spare, most valuable first, every victim the others make room without.
        let mut kept = Vec::with_capacity(victims.len());
        for &(id, victim_size) in victims.iter().rev() {
            if free - victim_size >= size {
                free -= victim_size;
                continue;
            }
            kept.push(id);
        }
        kept.reverse();
        Ok(kept)
    }

    /// Rank of a victim: smaller keys are evicted first.
    fn victim_key(&self, id: ExpertId, slot: &Slot, ctx: &EvictionContext<'_>) -> VictimKey {
        match self.policy {
            EvictionPolicy::Lru => VictimKey { stage: 0, primary: slot.last_use, value_bits: 0 },
            EvictionPolicy::TwoStage | EvictionPolicy::TwoStageLookahead => {
                let expert = ctx.model.expert(id);
                let usage = expert.map_or(0.0, |e| e.usage_prob);
                // Ours ranks by usage per byte held (loads are counted, not bytes); the paper's
                // stage 2 by usage alone.
                let value =
                    if self.policy.uses_queue_hints() { usage / slot.size.max(1) as f64 } else { usage };
                let next_use = if self.policy.uses_queue_hints() { (ctx.next_use)(id) } else { None };
                match next_use {
                    // Needed by queued work: keep to the last, then farthest next use first.
                    Some(pos) => VictimKey { stage: 4, primary: u64::MAX - pos, value_bits: value.to_bits() },
                    None => {
                        let stranded =
                            expert.and_then(|e| e.preliminary()).is_some_and(|p| !(ctx.is_resident)(p));
                        let duplicate = self.policy.uses_queue_hints() && (ctx.resident_elsewhere)(id);
                        let stage = match (stranded, duplicate) {
                            (true, _) => 1,
                            (false, true) => 2,
                            (false, false) => 3,
                        };
                        VictimKey { stage, primary: 0, value_bits: value.to_bits() }
                    }
                }
            }
        }
    }

    /// Make `expert` resident (its bytes counted from now on). The caller evicts first.
    pub fn admit(&mut self, expert: ExpertId, size: u64) -> Result<(), MemoryError> {
        if self.slots.contains_key(&expert) {
            return Err(MemoryError::AlreadyResident(expert));
        }
        if size > self.budget {
            return Err(MemoryError::TooLarge { expert, size, budget: self.budget });
        }
        if size > self.free_bytes() {
            return Err(MemoryError::NoRoom { expert, size, free: self.free_bytes() });
        }
        self.tick += 1;
        self.slots.insert(expert, Slot { size, pins: 0, last_use: self.tick });
        self.used += size;
        Ok(())
    }

    /// Drop `expert`, returning the bytes freed. Refused while it is pinned.
    pub fn evict(&mut self, expert: ExpertId) -> Result<u64, MemoryError> {
        let slot = self.slots.get(&expert).ok_or(MemoryError::NotResident(expert))?;
        if slot.pins > 0 {
            return Err(MemoryError::Pinned(expert));
        }
        let size = slot.size;
        self.slots.remove(&expert);
        self.used -= size;
        Ok(size)
    }

    /// Pin `expert` (a batch is loading or running it).
    pub fn pin(&mut self, expert: ExpertId) -> Result<(), MemoryError> {
        let slot = self.slots.get_mut(&expert).ok_or(MemoryError::NotResident(expert))?;
        slot.pins += 1;
        Ok(())
    }

    /// Release one pin of `expert`.
    pub fn unpin(&mut self, expert: ExpertId) -> Result<(), MemoryError> {
        let slot = self.slots.get_mut(&expert).ok_or(MemoryError::NotResident(expert))?;
        if slot.pins == 0 {
            return Err(MemoryError::NotPinned(expert));
        }
        slot.pins -= 1;
        Ok(())
    }

    /// Record a use of `expert` (LRU recency); ignored if it is not resident.
    pub fn touch(&mut self, expert: ExpertId) {
        self.tick += 1;
        if let Some(slot) = self.slots.get_mut(&expert) {
            slot.last_use = self.tick;
        }
    }
}

/// Eviction order key (smaller goes first): stage, then primary (LRU tick or reversed next use),
/// then value ascending (usage probability, or for ours usage per byte). The value is kept as
/// its IEEE bits, which order like the numbers for the non-negative finite values the model
/// guarantees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct VictimKey {
    stage: u8,
    primary: u64,
    value_bits: u64,
}

/// Loads Belady's MIN needs to serve `served` (expert uses in order) within `budget` bytes,
/// starting empty: on a miss, evict the resident expert whose next use is farthest (never used
/// again counts as farthest; ties evict the larger, then the higher id) until the expert fits.
///
/// With equal sizes this is the optimal offline policy. With variable sizes (the CoE case) the
/// exact optimum is NP-hard, and farthest-next-use is a heuristic bound, not exactly optimal: a
/// policy may occasionally need fewer loads than this number.
pub fn belady_min_loads(
    served: &[ExpertId],
    size_of: impl Fn(ExpertId) -> u64,
    budget: u64,
) -> Result<u64, MemoryError> {
    // next[i] = index of the next use of served[i] after i (usize::MAX if none).
    let mut next = vec![usize::MAX; served.len()];
    let mut last_seen: BTreeMap<ExpertId, usize> = BTreeMap::new();
    for (i, &e) in served.iter().enumerate().rev() {
        next[i] = last_seen.get(&e).copied().unwrap_or(usize::MAX);
        last_seen.insert(e, i);
    }
    replay_loads(
        served,
        size_of,
        budget,
        |i| next[i],
        |resident| {
            // farthest next use; ties evict the larger, then the higher id
            resident
                .iter()
                .max_by(|a, b| (a.1.0, a.1.1, a.0).cmp(&(b.1.0, b.1.1, b.0)))
                .map(|(&id, &(_, s))| (id, s))
        },
    )
}

/// Loads LRU needs to serve `served` within `budget` bytes, starting empty (for comparison with
/// [`belady_min_loads`] on the same order).
pub fn lru_loads(
    served: &[ExpertId],
    size_of: impl Fn(ExpertId) -> u64,
    budget: u64,
) -> Result<u64, MemoryError> {
    replay_loads(
        served,
        size_of,
        budget,
        |i| i,
        |resident| {
            // least recently used
            resident.iter().min_by_key(|(_, v)| v.0).map(|(&id, &(_, s))| (id, s))
        },
    )
}

/// Replays `served` through a cache of `budget` bytes starting empty and counts the loads. Each
/// resident expert carries `(stamp(i) of its latest use, size)`; on a miss, `victim` picks what
/// to evict until the expert fits, and the victims the later ones made unnecessary stay.
fn replay_loads(
    served: &[ExpertId],
    size_of: impl Fn(ExpertId) -> u64,
    budget: u64,
    stamp: impl Fn(usize) -> usize,
    victim: impl Fn(&BTreeMap<ExpertId, (usize, u64)>) -> Option<(ExpertId, u64)>,
) -> Result<u64, MemoryError> {
    let mut resident: BTreeMap<ExpertId, (usize, u64)> = BTreeMap::new();
    let mut used = 0u64;
    let mut loads = 0u64;
    for (i, &e) in served.iter().enumerate() {
        let size = size_of(e);
        if size > budget {
            return Err(MemoryError::TooLarge { expert: e, size, budget });
        }
        if let Some(slot) = resident.get_mut(&e) {
            slot.0 = stamp(i);
            continue;
        }
        let mut evicted = Vec::new();
        while used + size > budget {
            let Some((id, s)) = victim(&resident) else { break };
            if let Some(slot) = resident.remove(&id) {
                evicted.push((id, slot));
            }
            used -= s;
        }
        // As `plan_eviction` does: spare the victims the others already made room without.
        for (id, slot) in evicted.into_iter().rev() {
            if used + slot.1 + size <= budget {
                resident.insert(id, slot);
                used += slot.1;
            }
        }
        resident.insert(e, (stamp(i), size));
        used += size;
        loads += 1;
    }
    Ok(loads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coe::model::{ExpertSpec, Tier};

    /// e0 (root, p .6) -> e2 (p .5), e3 (p .1); e1 (root, p .4) -> e4 (p .9). All size 10.
    fn model() -> CoeModel {
        let s = |p: f64, parent: Option<u32>| ExpertSpec {
            size_bytes: 10,
            select_prob: p,
            home: Tier::Ssd,
            parent: parent.map(ExpertId),
        };
        CoeModel::new(vec![s(0.6, None), s(0.4, None), s(0.5, Some(0)), s(0.1, Some(0)), s(0.9, Some(1))])
            .unwrap()
    }

    fn plan(m: &ExpertManager, model: &CoeModel, e: u32) -> Result<Vec<ExpertId>, MemoryError> {
        let resident = |x: ExpertId| m.is_resident(x);
        let none = |_: ExpertId| None;
        let ctx = EvictionContext {
            model,
            is_resident: &resident,
            resident_elsewhere: &|_| false,
            next_use: &none,
        };
        m.plan_eviction(ExpertId(e), 10, &ctx)
    }

    #[test]
    fn two_stage_evicts_stranded_subsequent_first_then_by_probability() {
        let model = model();
        let mut m = ExpertManager::new(30, EvictionPolicy::TwoStage);
        // Resident: e0 (root .6), e4 (child of absent e1, usage .36), e3 (child of e0, usage .06).
        for e in [0, 4, 3] {
            m.admit(ExpertId(e), 10).unwrap();
        }
        // Stage 1: e4's preliminary e1 is not resident, so e4 goes first despite usage .36 > .06.
        assert_eq!(plan(&m, &model, 2).unwrap(), vec![ExpertId(4)]);
        m.evict(ExpertId(4)).unwrap();
        m.admit(ExpertId(1), 10).unwrap();
        // Now e0 .6, e3 .06, e1 .4 resident; nobody stranded: lowest usage (e3) goes.
        assert_eq!(plan(&m, &model, 2).unwrap(), vec![ExpertId(3)]);
    }

    /// The victim `policy` picks to make room for e2 with e0, e4 (stranded) and e3 resident,
    /// admitted in that order, and queued work needing the experts in `queued` at those positions.
    fn victim(policy: EvictionPolicy, queued: &[(u32, u64)]) -> Vec<ExpertId> {
        let model = model();
        let mut m = ExpertManager::new(30, policy);
        for e in [0, 4, 3] {
            m.admit(ExpertId(e), 10).unwrap();
        }
        let resident = |x: ExpertId| m.is_resident(x);
        let next_use = |x: ExpertId| queued.iter().find(|q| q.0 == x.0).map(|q| q.1);
        let ctx = EvictionContext {
            model: &model,
            is_resident: &resident,
            resident_elsewhere: &|_| false,
            next_use: &next_use,
        };
        m.plan_eviction(ExpertId(2), 10, &ctx).unwrap()
    }

    #[test]
    fn lookahead_keeps_what_queued_work_needs_where_plain_two_stage_evicts_it() {
        // Queued work needs the stranded e4 next.
        let queued = [(4, 0)];
        assert_eq!(victim(EvictionPolicy::TwoStage, &queued), vec![ExpertId(4)]);
        // Lookahead keeps e4; of the rest, e3 has the lowest usage (.06 < .6).
        assert_eq!(victim(EvictionPolicy::TwoStageLookahead, &queued), vec![ExpertId(3)]);
        // LRU ignores stages, probabilities and hints: e0, the oldest, goes although it is the
        // root with the highest usage.
        assert_eq!(victim(EvictionPolicy::Lru, &queued), vec![ExpertId(0)]);
    }

    #[test]
    fn lookahead_without_hints_decides_as_plain_two_stage() {
        assert_eq!(victim(EvictionPolicy::TwoStageLookahead, &[]), vec![ExpertId(4)]);
        assert_eq!(victim(EvictionPolicy::TwoStage, &[]), vec![ExpertId(4)]);
    }

    #[test]
    fn lookahead_ranks_by_usage_per_byte_where_plain_two_stage_ranks_by_usage() {
        // e0 (.6, 10 bytes), e1 (.4, 40 bytes) and e3 (.06, 4 bytes) resident, nobody stranded;
        // e2 needs 10 bytes and 6 are free. Per byte: e0 .06, e1 .01, e3 .015.
        let model = model();
        let none = |_: ExpertId| None;
        let victims = |policy| {
            let mut m = ExpertManager::new(60, policy);
            for (e, size) in [(0, 10), (1, 40), (3, 4)] {
                m.admit(ExpertId(e), size).unwrap();
            }
            let resident = |x: ExpertId| m.is_resident(x);
            let ctx = EvictionContext {
                model: &model,
                is_resident: &resident,
                resident_elsewhere: &|_| false,
                next_use: &none,
            };
            m.plan_eviction(ExpertId(2), 10, &ctx).unwrap()
        };
        // Ours frees the large, rarely used e1: the small e3 stays for its next request.
        assert_eq!(victims(EvictionPolicy::TwoStageLookahead), vec![ExpertId(1)]);
        // The paper's stage 2 takes the lowest usage, e3, whatever its size.
        assert_eq!(victims(EvictionPolicy::TwoStage), vec![ExpertId(3)]);
    }

    #[test]
    fn lookahead_evicts_the_farthest_next_use_when_everything_is_needed() {
        let queued = [(0, 5), (3, 2), (4, 0)];
        assert_eq!(victim(EvictionPolicy::TwoStageLookahead, &queued), vec![ExpertId(0)]);
        assert_eq!(victim(EvictionPolicy::TwoStage, &queued), vec![ExpertId(4)]);
    }

    #[test]
    fn policy_names_round_trip_and_unknown_names_list_the_valid_ones() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.name().parse::<EvictionPolicy>(), Ok(p));
        }
        let err = "fifo".parse::<EvictionPolicy>().unwrap_err().to_string();
        for p in EvictionPolicy::ALL {
            assert!(err.contains(p.name()), "{err:?} does not name {}", p.name());
        }
        assert!(err.contains("\"fifo\""), "{err:?}");
        assert!("Two-Stage".parse::<EvictionPolicy>().is_err(), "names are exact");
    }

    #[test]
    fn a_small_victim_taken_before_a_large_one_that_alone_makes_room_is_spared() {
        // LRU order: e0 (10 bytes) then e1 (30 bytes); a 30-byte expert needs e1 gone, and e1
        // alone makes room, so e0 stays.
        let model = model();
        let mut m = ExpertManager::new(40, EvictionPolicy::Lru);
        m.admit(ExpertId(0), 10).unwrap();
        m.admit(ExpertId(1), 30).unwrap();
        let resident = |x: ExpertId| m.is_resident(x);
        let none = |_: ExpertId| None;
        let ctx = EvictionContext {
            model: &model,
            is_resident: &resident,
            resident_elsewhere: &|_| false,
            next_use: &none,
        };
        assert_eq!(m.plan_eviction(ExpertId(2), 30, &ctx).unwrap(), vec![ExpertId(1)]);
        // Needing 35 bytes takes both.
        assert_eq!(m.plan_eviction(ExpertId(2), 35, &ctx).unwrap(), vec![ExpertId(0), ExpertId(1)]);
    }

    #[test]
    fn lookahead_evicts_a_copy_another_executor_holds_before_a_sole_copy() {
        // e0 (.6), e1 (.4) and e3 (.06) resident, nobody stranded; e0 is also held elsewhere.
        let model = model();
        let mut m = ExpertManager::new(30, EvictionPolicy::TwoStageLookahead);
        for e in [0, 1, 3] {
            m.admit(ExpertId(e), 10).unwrap();
        }
        let resident = |x: ExpertId| m.is_resident(x);
        let elsewhere = |x: ExpertId| x == ExpertId(0);
        let none = |_: ExpertId| None;
        let ctx = EvictionContext {
            model: &model,
            is_resident: &resident,
            resident_elsewhere: &elsewhere,
            next_use: &none,
        };
        assert_eq!(m.plan_eviction(ExpertId(2), 10, &ctx).unwrap(), vec![ExpertId(0)]);
        // The paper's two stages ignore other executors: lowest usage (e3) goes.
        let mut paper = ExpertManager::new(30, EvictionPolicy::TwoStage);
        for e in [0, 1, 3] {
            paper.admit(ExpertId(e), 10).unwrap();
        }
        assert_eq!(paper.plan_eviction(ExpertId(2), 10, &ctx).unwrap(), vec![ExpertId(3)]);
    }

    #[test]
    fn belady_spares_a_small_victim_a_large_one_made_unnecessary() {
        // Budget 40: a (10) and b (30) resident when c (30) arrives. a's next use is the
        // farther, so greedy takes a, then b; b alone makes room, so a stays.
        let size = |x: ExpertId| if x.0 == 0 { 10 } else { 30 };
        let order = [0, 1, 2, 1, 0].map(ExpertId);
        // a b c(b goes, a stays) b(c goes) a(hit): 4 loads; evicting a as well would cost 5.
        assert_eq!(belady_min_loads(&order, size, 40).unwrap(), 4);
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let model = model();
        let mut m = ExpertManager::new(30, EvictionPolicy::Lru);
        for e in [0, 1, 2] {
            m.admit(ExpertId(e), 10).unwrap();
        }
        m.touch(ExpertId(0));
        assert_eq!(plan(&m, &model, 3).unwrap(), vec![ExpertId(1)]);
    }

    #[test]
    fn pinned_experts_are_never_victims() {
        let model = model();
        let mut m = ExpertManager::new(20, EvictionPolicy::Lru);
        m.admit(ExpertId(0), 10).unwrap();
        m.admit(ExpertId(1), 10).unwrap();
        m.pin(ExpertId(0)).unwrap();
        assert_eq!(plan(&m, &model, 2).unwrap(), vec![ExpertId(1)]);
        m.pin(ExpertId(1)).unwrap();
        assert!(matches!(plan(&m, &model, 2), Err(MemoryError::NoRoom { .. })));
        assert_eq!(m.evict(ExpertId(1)), Err(MemoryError::Pinned(ExpertId(1))));
        m.unpin(ExpertId(1)).unwrap();
        assert_eq!(m.unpin(ExpertId(1)), Err(MemoryError::NotPinned(ExpertId(1))));
        assert_eq!(m.evict(ExpertId(1)), Ok(10));
        assert!(matches!(m.admit(ExpertId(2), 11), Err(MemoryError::NoRoom { .. })));
        assert!(matches!(m.admit(ExpertId(2), 21), Err(MemoryError::TooLarge { .. })));
        assert_eq!(m.used_bytes(), 10);
    }

    #[test]
    fn belady_beats_lru_on_a_cyclic_order() {
        // Cyclic a b c a b c ... with room for two: LRU misses every time, MIN keeps one.
        let order: Vec<ExpertId> = (0..12).map(|i| ExpertId(i % 3)).collect();
        assert_eq!(lru_loads(&order, |_| 1, 2).unwrap(), 12);
        // MIN by hand: a b | c evicts b | a hit | b evicts a | c hit | a evicts c | b hit |
        // c evicts b | a hit | b evicts a (never used again) | c hit: 7 loads.
        assert_eq!(belady_min_loads(&order, |_| 1, 2).unwrap(), 7);
    }

    #[test]
    fn belady_refuses_an_expert_larger_than_the_budget() {
        let order = [ExpertId(0)];
        assert!(matches!(belady_min_loads(&order, |_| 5, 4), Err(MemoryError::TooLarge { .. })));
    }
}
