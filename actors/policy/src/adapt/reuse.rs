//! Budgeted, disk-backed reuse cache for expert outputs (paper §3.3).
//!
//! * I/O-hiding token prefetch (§3.3.1): a batch plan lists every `Prefetch` (disk → DRAM) first,
//!   then per expert (in execution order) the `Compute`s of non-reusable tokens, then the
//!   `Reuse`s, so storage reads overlap GPU work instead of blocking it.
//! * Importance-aware residency (§3.3.2): after backprop each output token gets
//!   `I = P_reuse × n_reuse / n_compute` (for tokens shared by several experts, the max over
//!   them); under memory pressure it stays in DRAM iff `I > λ` (λ = 0.55 by default, §5.5.1),
//!   displacing less important residents, and the others go to the disk tier. An output below λ
//!   still takes free DRAM room (or keeps its place) while nothing needs it: a write to disk is
//!   paid only when the room is wanted, and low-importance residents are the first to leave.
//! * Idle eviction (§5.4.2 "Extreme case"): entries idle for `idle_after` leave DRAM, and disk
//!   entries idle for `disk_idle_after` are dropped.
//! * Clean disk copies: cached outputs never change, so a prefetch leaves the disk copy in place
//!   and demoting that entry again only drops it from DRAM. Each output is written to disk at most
//!   once while it stays cached; the disk budget counts every copy on disk, DRAM residents' included.
//! * Placement (§3.3.2): DRAM residents form one logical contiguous buffer laid out from low to
//!   high addresses by the execution order of their last expert, so entries that retire first
//!   sit together at the boundary and leave no holes.
//!
//! Calling protocol: per mini-batch call [`ReuseCache::handle_batch_start`] with the routed
//! tokens, drain [`ReuseCache::poll_action`] and execute the plan, then call
//! [`ReuseCache::handle_batch_done`] with the outputs (and their predicted `P_reuse`) and drain
//! again. Call [`ReuseCache::handle_timeout`] once `now` reaches [`ReuseCache::poll_timeout`].
//! Budgets hold after every call: DRAM bytes `<= dram_budget`, disk bytes `<= disk_budget`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::ExpertId;
use crate::Micros;

/// Default residency threshold λ (paper §5.5.1).
pub const DEFAULT_LAMBDA: f64 = 0.55;

/// Identity of one cached output: the expert and the token's signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenKey {
    /// Expert that produced the output.
    pub expert: ExpertId,
    /// Signature of the input token (e.g. a content hash).
    pub sig: u64,
}

/// Storage tier of a cached output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Device memory (the runtime-managed cache region).
    Dram,
    /// Backing disk.
    Disk,
}

/// Where a stored output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// DRAM cache region at a byte offset.
    Dram {
        /// Byte offset in the logical DRAM buffer.
        offset: u64,
    },
    /// The disk tier.
    Disk,
}

/// A decision for the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReuseAction {
    /// Read a cached output from disk into DRAM at `offset` (issued before compute starts). The
    /// disk copy stays: it is still valid, and a later demotion reuses it instead of writing.
    Prefetch {
        /// Output to read.
        key: TokenKey,
        /// Its size.
        bytes: u64,
        /// Destination offset in DRAM.
        offset: u64,
    },
    /// Compute this token through its expert.
    Compute {
        /// The token and expert.
        key: TokenKey,
    },
    /// Use the DRAM-resident output instead of computing.
    Reuse {
        /// The output to use.
        key: TokenKey,
    },
    /// Keep a fresh output at `at`.
    Store {
        /// The output.
        key: TokenKey,
        /// Its size.
        bytes: u64,
        /// Where it goes.
        at: Placement,
    },
    /// Move a DRAM resident to a new offset (placement by last-use order).
    Relocate {
        /// The output.
        key: TokenKey,
        /// New offset.
        offset: u64,
    },
    /// Drop an output from a tier.
    Evict {
        /// The output.
        key: TokenKey,
        /// Tier it leaves.
        tier: Tier,
    },
}

/// Cache configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseConfig {
    /// Bytes of DRAM the cache may hold.
    pub dram_budget: u64,
    /// Bytes of disk the cache may hold.
    pub disk_budget: u64,
    /// Residency threshold λ on importance.
    pub lambda: f64,
    /// DRAM entries unused this long are evicted to disk.
    pub idle_after: Micros,
    /// Disk entries unused this long are dropped.
    pub disk_idle_after: Micros,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            dram_budget: 150 << 20,
            disk_budget: 32 << 30,
            lambda: DEFAULT_LAMBDA,
            idle_after: Micros::from_secs(30),
            disk_idle_after: Micros::from_secs(600),
        }
    }
}

/// One token routed to an expert in the coming mini-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRequest {
    /// Token signature.
    pub sig: u64,
    /// Size of the expert's output for it.
    pub bytes: u64,
}

/// The tokens routed to one expert; a batch lists experts in execution order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertBatch {
    /// The expert.
    pub expert: ExpertId,
    /// Its tokens.
    pub tokens: Vec<TokenRequest>,
}

/// An output produced (or reused) in the finished batch, offered for residency.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputCandidate {
    /// The output.
    pub key: TokenKey,
    /// Its size.
    pub bytes: u64,
    /// Predicted reuse probability (see [`super::predictor::ReusePredictor`]).
    pub p_reuse: f64,
    /// Other experts (e.g. cross-task) that would reuse the same token.
    pub sharers: Vec<ExpertId>,
}

/// Summary of one batch plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchPlan {
    /// Tokens to compute.
    pub computed: u64,
    /// Tokens served from the cache (DRAM hits plus prefetches).
    pub reused: u64,
    /// Bytes read from disk by prefetches.
    pub prefetched_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    bytes: u64,
    /// Where it is served from: DRAM when resident there, else disk.
    tier: Tier,
    /// A copy is on disk (always for a `Disk` entry; for a DRAM one, left by its prefetch).
    on_disk: bool,
    last_use: Micros,
    last_order: u32,
    importance: f64,
    offset: u64,
}

/// The reuse-cache policy (see the module doc for the protocol).
#[derive(Debug, Clone)]
pub struct ReuseCache {
    cfg: ReuseConfig,
    entries: BTreeMap<TokenKey, Entry>,
    dram_used: u64,
    disk_used: u64,
    /// Per expert `(n_reuse, n_compute)` of the current batch, plus its execution position.
    batch: BTreeMap<ExpertId, (u64, u64, u32)>,
    /// DRAM entries admitted this round, announced (with their offset) by `place`.
    fresh: BTreeSet<TokenKey>,
    /// Keys of the batch being planned: their disk copies are never dropped to make room.
    pinned: BTreeSet<TokenKey>,
    actions: VecDeque<ReuseAction>,
}

/// Batches a stem entry may go unused before it leaves the reuse cache's memory tier of `budget`
/// bytes, where one batch of stems takes `batch_bytes`: at least 4, and at least as many batches
/// as the tier takes to fill. A task's images come back once per epoch, after the other tasks'
/// turns, so a clock shorter than the tier's turnover writes to disk what the next epoch reads
/// back; importance decides who leaves when the room is wanted.
pub fn idle_batches(budget: u64, batch_bytes: u64) -> u64 {
    (budget / batch_bytes.max(1)).max(4)
}

/// `I = P_reuse × max_j n_reuse_j / n_compute_j` (paper §3.3.2; `n_compute` floored at 1).
pub fn importance(p_reuse: f64, ratios: &[(u64, u64)]) -> f64 {
    ratios.iter().map(|&(r, c)| p_reuse * r as f64 / c.max(1) as f64).fold(0.0, f64::max)
}

impl ReuseCache {
    /// An empty cache.
    pub fn new(cfg: ReuseConfig) -> Self {
        ReuseCache {
            cfg,
            entries: BTreeMap::new(),
            dram_used: 0,
            disk_used: 0,
            batch: BTreeMap::new(),
            fresh: BTreeSet::new(),
            pinned: BTreeSet::new(),
            actions: VecDeque::new(),
        }
    }

    /// Bytes held in DRAM.
    pub fn dram_used(&self) -> u64 {
        self.dram_used
    }

    /// Bytes held on disk (every copy there, DRAM residents' clean copies included).
    pub fn disk_used(&self) -> u64 {
        self.disk_used
    }

    /// Tier of an output, if cached.
    pub fn tier_of(&self, key: &TokenKey) -> Option<Tier> {
        self.entries.get(key).map(|e| e.tier)
    }

    /// DRAM residents as `(key, offset, bytes)`, low to high address.
    pub fn dram_layout(&self) -> Vec<(TokenKey, u64, u64)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .filter(|(_, e)| e.tier == Tier::Dram)
            .map(|(k, e)| (*k, e.offset, e.bytes))
            .collect();
        v.sort_by_key(|&(k, off, _)| (off, k));
        v
    }

    /// Plans one mini-batch: prefetches first, then per expert computes before reuses.
    pub fn handle_batch_start(&mut self, now: Micros, experts: &[ExpertBatch]) -> BatchPlan {
        self.batch.clear();
        let mut plan = BatchPlan::default();
        let mut prefetches = Vec::new();
        let mut per_expert: Vec<(Vec<ReuseAction>, Vec<ReuseAction>)> = Vec::new();
        self.pinned = experts
            .iter()
            .flat_map(|eb| eb.tokens.iter().map(|t| TokenKey { expert: eb.expert, sig: t.sig }))
            .collect();
        for (pos, eb) in experts.iter().enumerate() {
            let pos = pos as u32;
            let (mut computes, mut reuses) = (Vec::new(), Vec::new());
            let counters = self.batch.entry(eb.expert).or_insert((0, 0, pos));
            counters.2 = pos;
            for t in &eb.tokens {
                let key = TokenKey { expert: eb.expert, sig: t.sig };
                if let Some(e) = self.entries.get(&key).copied()
                    && e.tier == Tier::Disk
                    && self.dram_used + e.bytes > self.cfg.dram_budget
                {
                    self.make_room_for_prefetch(now, e.bytes);
                }
                let hit = match self.entries.get_mut(&key) {
                    Some(e) if e.tier == Tier::Dram => {
                        e.last_use = now;
                        e.last_order = pos;
                        true
                    }
                    Some(e) if self.dram_used + e.bytes <= self.cfg.dram_budget => {
                        // The disk copy stays (clean), still counted on disk.
                        e.tier = Tier::Dram;
                        e.last_use = now;
                        e.last_order = pos;
                        e.offset = self.dram_used;
                        self.dram_used += e.bytes;
                        plan.prefetched_bytes += e.bytes;
                        prefetches.push(ReuseAction::Prefetch { key, bytes: e.bytes, offset: e.offset });
                        true
                    }
                    _ => false,
                };
                let c = self.batch.entry(eb.expert).or_insert((0, 0, pos));
                if hit {
                    c.0 += 1;
                    plan.reused += 1;
                    reuses.push(ReuseAction::Reuse { key });
                } else {
                    c.1 += 1;
                    plan.computed += 1;
                    computes.push(ReuseAction::Compute { key });
                }
            }
            per_expert.push((computes, reuses));
        }
        self.pinned.clear();
        // A prefetch's offset as laid out after any room made for a later one.
        let prefetches: Vec<ReuseAction> = prefetches
            .into_iter()
            .map(|a| match a {
                ReuseAction::Prefetch { key, bytes, offset } => ReuseAction::Prefetch {
                    key,
                    bytes,
                    offset: self.entries.get(&key).map_or(offset, |e| e.offset),
                },
                other => other,
            })
            .collect();
        self.actions.extend(prefetches);
        for (computes, reuses) in per_expert {
            self.actions.extend(computes);
            self.actions.extend(reuses);
        }
        plan
    }

    /// After backprop: keep outputs with `I > λ` in DRAM, send the rest to disk, re-place DRAM.
    pub fn handle_batch_done(&mut self, now: Micros, outputs: &[OutputCandidate]) {
        let mut scored: Vec<(f64, usize)> = outputs
            .iter()
            .enumerate()
            .map(|(i, out)| {
                let ratios: Vec<(u64, u64)> = std::iter::once(&out.key.expert)
                    .chain(&out.sharers)
                    .map(|e| {
                        let (r, c, _) = self.batch.get(e).copied().unwrap_or((0, 0, 0));
                        (r, c)
                    })
                    .collect();
                (importance(out.p_reuse, &ratios), i)
            })
            .collect();
        // Most important first, so a later candidate never displaces one stored this round.
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for (imp, i) in scored {
            let out = &outputs[i];
            let order = self.batch.get(&out.key.expert).map(|c| c.2).unwrap_or(u32::MAX);
            let in_dram = self.entries.get(&out.key).is_some_and(|e| e.tier == Tier::Dram);
            let free = self.dram_used + out.bytes <= self.cfg.dram_budget;
            if imp > self.cfg.lambda || in_dram || free {
                // Below λ it only takes free room (or keeps its place) and is the first to leave.
                self.keep_in_dram(now, out, imp, order);
            } else {
                self.send_to_disk(now, out, order);
            }
        }
        self.place();
    }

    /// Frees `bytes` of DRAM for a prefetch by demoting residents below λ that this batch does not
    /// use, least important and least recently used first, then compacts the layout; nothing when
    /// they cannot free enough (the token is computed instead).
    fn make_room_for_prefetch(&mut self, now: Micros, bytes: u64) {
        let mut victims: Vec<(f64, Micros, TokenKey, u64)> = self
            .entries
            .iter()
            .filter(|(k, e)| {
                e.tier == Tier::Dram && e.importance <= self.cfg.lambda && !self.pinned.contains(k)
            })
            .map(|(k, e)| (e.importance, e.last_use, *k, e.bytes))
            .collect();
        let free = self.cfg.dram_budget - self.dram_used;
        if free + victims.iter().map(|v| v.3).sum::<u64>() < bytes {
            return;
        }
        victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (_, _, k, _) in victims {
            if self.cfg.dram_budget - self.dram_used >= bytes {
                break;
            }
            self.demote(now, k);
        }
        self.place();
    }

    /// Evicts idle entries (DRAM to disk, disk dropped).
    pub fn handle_timeout(&mut self, now: Micros) {
        let idle: Vec<(TokenKey, Tier)> = self
            .entries
            .iter()
            .filter(|(_, e)| match e.tier {
                Tier::Dram => now.saturating_sub(e.last_use) >= self.cfg.idle_after,
                Tier::Disk => now.saturating_sub(e.last_use) >= self.cfg.disk_idle_after,
            })
            .map(|(k, e)| (*k, e.tier))
            .collect();
        for (key, tier) in idle {
            match tier {
                Tier::Dram => self.demote(now, key),
                Tier::Disk => self.drop_entry(key),
            }
        }
        self.place();
    }

    /// The executor found the disk copy of `key` unreadable or corrupt: it is dropped (an
    /// `Evict { tier: Disk }` follows), so the next demotion writes a good one.
    pub fn disk_copy_lost(&mut self, key: &TokenKey) {
        match self.entries.get(key).map(|e| e.tier) {
            Some(Tier::Dram) => self.drop_disk_copy(*key),
            Some(Tier::Disk) => self.drop_entry(*key),
            None => {}
        }
    }

    /// Next decision, if any.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<ReuseAction> {
        self.actions.pop_front()
    }

    /// When the next idle eviction is due.
    pub fn poll_timeout(&self) -> Option<Micros> {
        self.entries
            .values()
            .map(|e| {
                e.last_use
                    + match e.tier {
                        Tier::Dram => self.cfg.idle_after,
                        Tier::Disk => self.cfg.disk_idle_after,
                    }
            })
            .min()
    }

    fn keep_in_dram(&mut self, now: Micros, out: &OutputCandidate, imp: f64, order: u32) {
        match self.entries.get_mut(&out.key) {
            Some(e) if e.tier == Tier::Dram => {
                e.importance = imp;
                e.last_use = now;
                e.last_order = order;
                return;
            }
            // On disk in another size: that copy is stale.
            Some(e) if e.bytes != out.bytes => self.drop_entry(out.key),
            // On disk only: it stays there unless DRAM takes it below.
            Some(_) if out.bytes > self.cfg.dram_budget => {
                self.send_to_disk(now, out, order);
                return;
            }
            Some(_) => {}
            None if out.bytes > self.cfg.dram_budget => {
                self.send_to_disk(now, out, order);
                return;
            }
            None => {}
        }
        // Make room by evicting strictly less important residents, least important first.
        let mut victims: Vec<(f64, TokenKey)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.tier == Tier::Dram && e.importance < imp)
            .map(|(k, e)| (e.importance, *k))
            .collect();
        victims.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut free = self.cfg.dram_budget - self.dram_used;
        let mut chosen = Vec::new();
        for (_, k) in victims {
            if free >= out.bytes {
                break;
            }
            free += self.entries.get(&k).map_or(0, |e| e.bytes);
            chosen.push(k);
        }
        if free < out.bytes {
            self.send_to_disk(now, out, order);
            return;
        }
        for k in chosen {
            self.demote(now, k);
        }
        // A disk copy of it (if demoting made no room by dropping it) stays, clean.
        let on_disk = self.entries.get(&out.key).is_some_and(|e| e.on_disk);
        self.dram_used += out.bytes;
        self.entries.insert(
            out.key,
            Entry {
                bytes: out.bytes,
                tier: Tier::Dram,
                on_disk,
                last_use: now,
                last_order: order,
                importance: imp,
                offset: 0,
            },
        );
        self.fresh.insert(out.key);
    }

    fn send_to_disk(&mut self, now: Micros, out: &OutputCandidate, order: u32) {
        match self.entries.get(&out.key).copied() {
            Some(e) if e.tier == Tier::Dram => self.demote(now, out.key),
            Some(_) => {
                if let Some(e) = self.entries.get_mut(&out.key) {
                    e.last_use = now;
                    e.last_order = order;
                }
            }
            None => {
                if self.make_disk_room(out.bytes) {
                    self.disk_used += out.bytes;
                    self.entries.insert(
                        out.key,
                        Entry {
                            bytes: out.bytes,
                            tier: Tier::Disk,
                            on_disk: true,
                            last_use: now,
                            last_order: order,
                            importance: 0.0,
                            offset: 0,
                        },
                    );
                    self.actions.push_back(ReuseAction::Store {
                        key: out.key,
                        bytes: out.bytes,
                        at: Placement::Disk,
                    });
                }
            }
        }
    }

    /// Moves a DRAM entry to disk: its clean disk copy when it has one (nothing written), else a
    /// write, or it is dropped if the disk has no room.
    fn demote(&mut self, now: Micros, key: TokenKey) {
        let Some(e) = self.entries.get(&key).copied().filter(|e| e.tier == Tier::Dram) else {
            return;
        };
        self.dram_used -= e.bytes;
        if !self.fresh.remove(&key) {
            self.actions.push_back(ReuseAction::Evict { key, tier: Tier::Dram });
        }
        let last_use = e.last_use.min(now);
        if e.on_disk {
            self.entries.insert(key, Entry { tier: Tier::Disk, last_use, offset: 0, ..e });
            return;
        }
        self.entries.remove(&key);
        if self.make_disk_room(e.bytes) {
            self.disk_used += e.bytes;
            self.entries.insert(key, Entry { tier: Tier::Disk, on_disk: true, last_use, offset: 0, ..e });
            self.actions.push_back(ReuseAction::Store { key, bytes: e.bytes, at: Placement::Disk });
        }
    }

    /// Drops least recently used disk copies until `bytes` fit (a DRAM resident keeps its DRAM
    /// copy); false if they never can.
    fn make_disk_room(&mut self, bytes: u64) -> bool {
        if bytes > self.cfg.disk_budget {
            return false;
        }
        while self.disk_used + bytes > self.cfg.disk_budget {
            let lru = self
                .entries
                .iter()
                .filter(|(k, e)| e.on_disk && !self.pinned.contains(k))
                .min_by_key(|(k, e)| (e.last_use, **k))
                .map(|(k, e)| (*k, e.tier));
            match lru {
                Some((k, Tier::Disk)) => self.drop_entry(k),
                Some((k, Tier::Dram)) => self.drop_disk_copy(k),
                None => return false,
            }
        }
        true
    }

    /// Removes the disk copy of a DRAM resident.
    fn drop_disk_copy(&mut self, key: TokenKey) {
        if let Some(e) = self.entries.get_mut(&key).filter(|e| e.on_disk) {
            e.on_disk = false;
            self.disk_used -= e.bytes;
            self.actions.push_back(ReuseAction::Evict { key, tier: Tier::Disk });
        }
    }

    fn drop_entry(&mut self, key: TokenKey) {
        if let Some(e) = self.entries.remove(&key) {
            if e.tier == Tier::Dram {
                self.dram_used -= e.bytes;
                if !self.fresh.remove(&key) {
                    self.actions.push_back(ReuseAction::Evict { key, tier: Tier::Dram });
                }
            }
            if e.on_disk {
                self.disk_used -= e.bytes;
                self.actions.push_back(ReuseAction::Evict { key, tier: Tier::Disk });
            }
        }
    }

    /// Lays DRAM residents out low to high by (last expert's execution order, key).
    fn place(&mut self) {
        let mut dram: Vec<(u32, TokenKey)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.tier == Tier::Dram)
            .map(|(k, e)| (e.last_order, *k))
            .collect();
        dram.sort();
        let mut offset = 0u64;
        let mut stores = Vec::new();
        for (_, k) in dram {
            if let Some(e) = self.entries.get_mut(&k) {
                if self.fresh.contains(&k) {
                    stores.push(ReuseAction::Store {
                        key: k,
                        bytes: e.bytes,
                        at: Placement::Dram { offset },
                    });
                } else if e.offset != offset {
                    self.actions.push_back(ReuseAction::Relocate { key: k, offset });
                }
                e.offset = offset;
                offset += e.bytes;
            }
        }
        self.fresh.clear();
        self.actions.extend(stores);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(e: u32, sig: u64) -> TokenKey {
        TokenKey { expert: ExpertId(e), sig }
    }

    fn cfg(dram: u64, disk: u64) -> ReuseConfig {
        ReuseConfig {
            dram_budget: dram,
            disk_budget: disk,
            lambda: DEFAULT_LAMBDA,
            idle_after: Micros::from_secs(10),
            disk_idle_after: Micros::from_secs(100),
        }
    }

    fn drain(c: &mut ReuseCache) -> Vec<ReuseAction> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    fn cand(e: u32, sig: u64, bytes: u64, p: f64) -> OutputCandidate {
        OutputCandidate { key: key(e, sig), bytes, p_reuse: p, sharers: Vec::new() }
    }

    #[test]
    fn the_idle_clock_covers_the_memory_tiers_turnover() {
        assert_eq!(idle_batches(100, 10), 10);
        assert_eq!(idle_batches(10, 10), 4);
        assert_eq!(idle_batches(10, 0), 10);
    }

    #[test]
    fn importance_keep_and_evict_by_hand() {
        // I = 0.9 * 3 / 4 = 0.675 > 0.55 (keep); I = 0.6 * 3 / 4 = 0.45 (evict);
        // cross-task max: 0.6 * max(3/4, 2/1) = 1.2 (keep).
        assert!((importance(0.9, &[(3, 4)]) - 0.675).abs() < 1e-12);
        assert!((importance(0.6, &[(3, 4)]) - 0.45).abs() < 1e-12);
        assert!((importance(0.6, &[(3, 4), (2, 1)]) - 1.2).abs() < 1e-12);
    }

    #[test]
    fn plan_prefetches_first_and_computes_before_reuses() {
        let mut c = ReuseCache::new(cfg(1_000, 10_000));
        // Batch 1: both tokens are new, so they are computed.
        let _ = c.handle_batch_start(
            Micros(0),
            &[ExpertBatch {
                expert: ExpertId(0),
                tokens: vec![TokenRequest { sig: 1, bytes: 10 }, TokenRequest { sig: 2, bytes: 10 }],
            }],
        );
        drain(&mut c);
        c.handle_batch_done(Micros(1), &[cand(0, 1, 10, 0.9), cand(0, 2, 10, 0.9)]);
        // Nothing was reused in that batch, so I = 0 for both, but DRAM has room: both stay.
        assert_eq!(c.tier_of(&key(0, 1)), Some(Tier::Dram));
        assert_eq!((c.dram_used(), c.disk_used()), (20, 0));
        drain(&mut c);
        // Idle for 10 s they leave DRAM for disk.
        c.handle_timeout(Micros::from_secs(11));
        assert_eq!((c.tier_of(&key(0, 2)), c.dram_used(), c.disk_used()), (Some(Tier::Disk), 0, 20));
        drain(&mut c);
        let plan = c.handle_batch_start(
            Micros::from_secs(12),
            &[ExpertBatch {
                expert: ExpertId(0),
                tokens: vec![
                    TokenRequest { sig: 1, bytes: 10 },
                    TokenRequest { sig: 3, bytes: 10 },
                    TokenRequest { sig: 2, bytes: 10 },
                ],
            }],
        );
        assert_eq!(plan, BatchPlan { computed: 1, reused: 2, prefetched_bytes: 20 });
        let acts = drain(&mut c);
        assert_eq!(
            acts,
            vec![
                ReuseAction::Prefetch { key: key(0, 1), bytes: 10, offset: 0 },
                ReuseAction::Prefetch { key: key(0, 2), bytes: 10, offset: 10 },
                ReuseAction::Compute { key: key(0, 3) },
                ReuseAction::Reuse { key: key(0, 1) },
                ReuseAction::Reuse { key: key(0, 2) },
            ]
        );
        // Now n_reuse = 2, n_compute = 1: token 3 with p 0.3 -> I = 0.6 keep; token 1 with p 0.2
        // -> 0.4 < λ, but nothing needs its room: it keeps its place.
        c.handle_batch_done(Micros::from_secs(13), &[cand(0, 3, 10, 0.3), cand(0, 1, 10, 0.2)]);
        assert_eq!(c.tier_of(&key(0, 3)), Some(Tier::Dram));
        assert_eq!(c.tier_of(&key(0, 1)), Some(Tier::Dram));
        assert_eq!(c.dram_used(), 30);
    }

    #[test]
    fn below_lambda_goes_to_disk_only_when_dram_is_full() {
        let mut c = ReuseCache::new(cfg(10, 100));
        let b = |sigs: &[u64]| ExpertBatch {
            expert: ExpertId(0),
            tokens: sigs.iter().map(|&sig| TokenRequest { sig, bytes: 10 }).collect(),
        };
        let _ = c.handle_batch_start(Micros(0), &[b(&[1, 2])]);
        drain(&mut c);
        // Both at I = 0: the first takes the free room, the second finds none and is written.
        c.handle_batch_done(Micros(0), &[cand(0, 1, 10, 0.9), cand(0, 2, 10, 0.9)]);
        assert_eq!((c.tier_of(&key(0, 1)), c.tier_of(&key(0, 2))), (Some(Tier::Dram), Some(Tier::Disk)));
        assert!(drain(&mut c).contains(&ReuseAction::Store {
            key: key(0, 2),
            bytes: 10,
            at: Placement::Disk
        }));
    }

    #[test]
    fn idle_entries_leave_dram_then_disk() {
        let mut c = ReuseCache::new(cfg(100, 100));
        let _ = c.handle_batch_start(Micros(0), &[ExpertBatch { expert: ExpertId(1), tokens: vec![] }]);
        c.handle_batch_done(Micros(0), &[cand(1, 9, 40, 0.9)]);
        assert_eq!(c.tier_of(&key(1, 9)), Some(Tier::Dram));
        assert_eq!(c.poll_timeout(), Some(Micros::from_secs(10)));
        c.handle_timeout(Micros::from_secs(10));
        assert_eq!(c.tier_of(&key(1, 9)), Some(Tier::Disk));
        assert_eq!(c.poll_timeout(), Some(Micros::from_secs(100)));
        c.handle_timeout(Micros::from_secs(100));
        assert_eq!(c.tier_of(&key(1, 9)), None);
        assert_eq!(c.disk_used(), 0);
    }

    #[test]
    fn a_prefetched_entry_is_demoted_without_a_second_write() {
        let mut c = ReuseCache::new(cfg(10, 100));
        let start = |c: &mut ReuseCache, t: u64, sig: u64| {
            let b = ExpertBatch { expert: ExpertId(0), tokens: vec![TokenRequest { sig, bytes: 10 }] };
            c.handle_batch_start(Micros(t), &[b])
        };
        // Computed, not reused (I = 0); idle for 10 s it is written to disk, once.
        let _ = start(&mut c, 0, 1);
        drain(&mut c);
        c.handle_batch_done(Micros(0), &[cand(0, 1, 10, 0.9)]);
        drain(&mut c);
        c.handle_timeout(Micros::from_secs(10));
        assert!(drain(&mut c).contains(&ReuseAction::Store {
            key: key(0, 1),
            bytes: 10,
            at: Placement::Disk
        }));
        // Prefetched back: DRAM holds it, the disk copy stays counted.
        let s = Micros::from_secs(10).0;
        assert_eq!(start(&mut c, s + 1, 1).prefetched_bytes, 10);
        drain(&mut c);
        assert_eq!((c.tier_of(&key(0, 1)), c.dram_used(), c.disk_used()), (Some(Tier::Dram), 10, 10));
        // A more important newcomer (reused 1, computed 1: I = 0.9) displaces it: it leaves DRAM
        // with no write.
        let both = ExpertBatch {
            expert: ExpertId(0),
            tokens: vec![TokenRequest { sig: 1, bytes: 10 }, TokenRequest { sig: 2, bytes: 10 }],
        };
        let _ = c.handle_batch_start(Micros(s + 2), &[both]);
        drain(&mut c);
        c.handle_batch_done(Micros(s + 2), &[cand(0, 2, 10, 0.9)]);
        let acts = drain(&mut c);
        assert_eq!(
            acts,
            vec![
                ReuseAction::Evict { key: key(0, 1), tier: Tier::Dram },
                ReuseAction::Store { key: key(0, 2), bytes: 10, at: Placement::Dram { offset: 0 } },
            ]
        );
        assert_eq!((c.tier_of(&key(0, 1)), c.dram_used(), c.disk_used()), (Some(Tier::Disk), 10, 10));
    }

    #[test]
    fn a_prefetch_displaces_an_idle_resident_below_lambda() {
        let mut c = ReuseCache::new(cfg(10, 100));
        let b = |sig| ExpertBatch { expert: ExpertId(0), tokens: vec![TokenRequest { sig, bytes: 10 }] };
        // Token 1 goes to disk (idle), token 2 takes the free room at I = 0.
        let _ = c.handle_batch_start(Micros(0), &[b(1)]);
        c.handle_batch_done(Micros(0), &[cand(0, 1, 10, 0.9)]);
        c.handle_timeout(Micros::from_secs(10));
        let s = Micros::from_secs(10).0;
        let _ = c.handle_batch_start(Micros(s + 1), &[b(2)]);
        c.handle_batch_done(Micros(s + 1), &[cand(0, 2, 10, 0.9)]);
        drain(&mut c);
        assert_eq!((c.tier_of(&key(0, 1)), c.tier_of(&key(0, 2))), (Some(Tier::Disk), Some(Tier::Dram)));
        // Token 1 is wanted again: token 2 (unused by this batch, I = 0) is written out for it.
        let plan = c.handle_batch_start(Micros(s + 2), &[b(1)]);
        assert_eq!(plan.prefetched_bytes, 10);
        assert_eq!(
            drain(&mut c),
            vec![
                ReuseAction::Evict { key: key(0, 2), tier: Tier::Dram },
                ReuseAction::Store { key: key(0, 2), bytes: 10, at: Placement::Disk },
                ReuseAction::Prefetch { key: key(0, 1), bytes: 10, offset: 0 },
                ReuseAction::Reuse { key: key(0, 1) },
            ]
        );
        assert_eq!((c.dram_used(), c.disk_used()), (10, 20));
    }

    #[test]
    fn a_full_disk_drops_a_dram_residents_copy_before_refusing() {
        let mut c = ReuseCache::new(cfg(10, 10));
        let b = |sig| ExpertBatch { expert: ExpertId(0), tokens: vec![TokenRequest { sig, bytes: 10 }] };
        let _ = c.handle_batch_start(Micros(0), &[b(1)]);
        c.handle_batch_done(Micros(0), &[cand(0, 1, 10, 0.9)]);
        drain(&mut c);
        // Idle, it is written to disk; prefetched back, its copy stays there.
        c.handle_timeout(Micros::from_secs(10));
        let s = Micros::from_secs(10).0;
        let _ = c.handle_batch_start(Micros(s + 1), &[b(1)]);
        drain(&mut c);
        // Token 1 is in DRAM with its copy filling the disk; token 2 goes to disk in its place.
        c.handle_batch_done(Micros(s + 2), &[cand(0, 2, 10, 0.0)]);
        let acts = drain(&mut c);
        assert!(acts.contains(&ReuseAction::Evict { key: key(0, 1), tier: Tier::Disk }), "{acts:?}");
        assert!(acts.contains(&ReuseAction::Store { key: key(0, 2), bytes: 10, at: Placement::Disk }));
        assert_eq!((c.tier_of(&key(0, 1)), c.tier_of(&key(0, 2))), (Some(Tier::Dram), Some(Tier::Disk)));
        assert_eq!((c.dram_used(), c.disk_used()), (10, 10));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Batch(Vec<(u32, u64, u64)>),
        Done(Vec<(u32, u64, u64, f64)>),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            proptest::collection::vec((0u32..4, 0u64..12, 1u64..60), 0..12).prop_map(Op::Batch),
            proptest::collection::vec((0u32..4, 0u64..12, 1u64..60, 0.0f64..1.0), 0..12).prop_map(Op::Done),
            (0u64..20).prop_map(Op::Tick),
        ]
    }

    proptest! {
        #[test]
        fn cache_never_exceeds_its_budgets_and_actions_replay_the_state(
            ops in proptest::collection::vec(op(), 1..40),
            dram in 0u64..200,
            disk in 0u64..400,
        ) {
            let mut c = ReuseCache::new(cfg(dram, disk));
            let mut now = Micros(0);
            // Replayed view of the tiers from the action stream alone.
            let mut dram_bytes: BTreeMap<TokenKey, u64> = BTreeMap::new();
            let mut disk_bytes: BTreeMap<TokenKey, u64> = BTreeMap::new();
            for o in ops {
                match o {
                    Op::Batch(ts) => {
                        let mut by_e: BTreeMap<u32, Vec<TokenRequest>> = BTreeMap::new();
                        for (e, s, b) in ts { by_e.entry(e).or_default().push(TokenRequest { sig: s, bytes: b }); }
                        let eb: Vec<_> = by_e.into_iter().map(|(e, tokens)| ExpertBatch { expert: ExpertId(e), tokens }).collect();
                        let _ = c.handle_batch_start(now, &eb);
                    }
                    Op::Done(cs) => {
                        let cs: Vec<_> = cs.into_iter().map(|(e, s, b, p)| cand(e, s, b, p)).collect();
                        c.handle_batch_done(now, &cs);
                    }
                    Op::Tick(s) => { now = now + Micros::from_secs(s); c.handle_timeout(now); }
                }
                while let Some(a) = c.poll_action() {
                    match a {
                        ReuseAction::Prefetch { key, bytes, .. } => {
                            // The disk copy stays.
                            prop_assert_eq!(disk_bytes.get(&key), Some(&bytes));
                            prop_assert!(dram_bytes.insert(key, bytes).is_none());
                        }
                        ReuseAction::Store { key, bytes, at: Placement::Dram { offset } } => {
                            prop_assert!(offset + bytes <= dram);
                            dram_bytes.insert(key, bytes);
                        }
                        ReuseAction::Store { key, bytes, at: Placement::Disk } => {
                            // Never a second write of a copy already on disk.
                            prop_assert!(disk_bytes.insert(key, bytes).is_none());
                        }
                        ReuseAction::Evict { key, tier: Tier::Dram } => { prop_assert!(dram_bytes.remove(&key).is_some()); }
                        ReuseAction::Evict { key, tier: Tier::Disk } => { prop_assert!(disk_bytes.remove(&key).is_some()); }
                        ReuseAction::Compute { .. } | ReuseAction::Reuse { .. } | ReuseAction::Relocate { .. } => {}
                    }
                }
                prop_assert!(c.dram_used() <= dram);
                prop_assert!(c.disk_used() <= disk);
                prop_assert_eq!(dram_bytes.values().sum::<u64>(), c.dram_used());
                prop_assert_eq!(disk_bytes.values().sum::<u64>(), c.disk_used());
                // Layout is contiguous from 0 with no holes.
                let mut next = 0;
                for (_, off, b) in c.dram_layout() { prop_assert_eq!(off, next); next += b; }
            }
        }
    }
}
