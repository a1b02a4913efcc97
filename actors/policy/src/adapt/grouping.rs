//! Fragmentation-aware cross-task expert grouping (paper §3.2.1, "Cross-task expert grouping").
//!
//! Experts pooled across models are packed into ordered time slices. Each slice is a 0/1
//! knapsack over the remaining experts with weight `w_i = M_tmp^i` and value
//! `v_i = M_tmp^i / M_c - η r_e` under capacity `M_c - M_s`:
//! `dp[i][j] = max(dp[i-1][j], dp[i-1][j - w_i] + v_i)`, repeated until every expert is placed.
//! The `-η r_e` term is the shortest-job-first bias: long experts are worth less, so they are
//! deferred to later slices, and slices are finally ordered by makespan (shortest first).
//! When the DP cannot place an expert (its value is not positive, or weight rounding makes it
//! not fit the DP grid) the rest falls back to aligned random grouping (paper §5.4.1, "Extreme
//! case"), seeded by the caller's `SmallRng`.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;

use super::ExpertId;
use crate::Micros;

/// One expert eligible to co-run: its temporary memory `M_tmp` and estimated lifespan `r_e`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupingItem {
    /// The expert.
    pub expert: ExpertId,
    /// Estimated temporary bytes `M_tmp` (see [`super::memory::MemoryModel`]).
    pub temp_bytes: u64,
    /// Estimated runtime `r_e` within the slice.
    pub lifespan: Micros,
}

/// Knobs of the grouper.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupingConfig {
    /// `M_c`: device memory available to the co-adaptation pool, in bytes.
    pub device_budget: u64,
    /// `M_s`: static memory already held (weights, optimizer state), in bytes.
    pub static_bytes: u64,
    /// `η`: weight of lifespan against memory utilisation, per second of `r_e`.
    pub eta_per_sec: f64,
    /// Most DP capacity cells; bytes are bucketed (rounded up) so the DP stays this small.
    pub max_dp_cells: usize,
    /// Most experts per slice (e.g. the compute threads, since each expert needs at least one);
    /// a DP choice above it keeps its highest-value experts and returns the rest to the pool.
    pub max_slice_experts: usize,
}

impl Default for GroupingConfig {
    fn default() -> Self {
        GroupingConfig {
            device_budget: 24 << 30,
            static_bytes: 0,
            eta_per_sec: 0.01,
            max_dp_cells: 1024,
            max_slice_experts: usize::MAX,
        }
    }
}

/// One ordered time slice: experts that co-run and are allocated together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeSlice {
    /// Experts in the slice, in input order.
    pub experts: Vec<ExpertId>,
    /// Sum of their temporary bytes.
    pub temp_bytes: u64,
    /// `max r_e` over the slice.
    pub makespan: Micros,
}

/// A full grouping: slices in execution order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grouping {
    /// Slices, shortest makespan first.
    pub slices: Vec<TimeSlice>,
    /// Experts the DP could not place and the fallback grouped.
    pub fallback_experts: usize,
}

impl Grouping {
    /// `L(E) = Σ_S max_{e∈S} r_e`, the cross-slice latency the grouper minimises.
    pub fn total_latency(&self) -> Micros {
        self.slices.iter().fold(Micros::ZERO, |acc, s| acc + s.makespan)
    }
}

/// Why experts could not be grouped at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupingError {
    /// `M_s` alone exceeds `M_c`.
    #[error("static memory {static_bytes} B exceeds the device budget {budget} B")]
    StaticExceedsBudget {
        /// `M_s`.
        static_bytes: u64,
        /// `M_c`.
        budget: u64,
    },
    /// One expert needs more temporary memory than the device has free.
    #[error("expert {expert:?} needs {need} B but only {available} B are free")]
    ExpertTooLarge {
        /// The expert.
        expert: ExpertId,
        /// Its `M_tmp`.
        need: u64,
        /// `M_c - M_s`.
        available: u64,
    },
}

/// The knapsack value `v_i = M_tmp^i / M_c - η r_e` (paper §3.2.1).
pub fn expert_value(item: &GroupingItem, cfg: &GroupingConfig) -> f64 {
    let budget = cfg.device_budget.max(1) as f64;
    item.temp_bytes as f64 / budget - cfg.eta_per_sec * item.lifespan.as_secs_f64()
}

/// Packs `items` into ordered time slices under `M_c - M_s` (see the module doc).
pub fn group_experts(
    items: &[GroupingItem],
    cfg: &GroupingConfig,
    rng: &mut SmallRng,
) -> Result<Grouping, GroupingError> {
    let available = capacity(cfg)?;
    if let Some(big) = items.iter().find(|i| i.temp_bytes > available) {
        return Err(GroupingError::ExpertTooLarge { expert: big.expert, need: big.temp_bytes, available });
    }
    let unit = available.div_ceil(cfg.max_dp_cells.max(1) as u64).max(1);
    let cells = (available / unit) as usize;
    let mut remaining: Vec<GroupingItem> = items.to_vec();
    let mut slices = Vec::new();
    while !remaining.is_empty() {
        let mut chosen = knapsack(&remaining, cfg, unit, cells);
        if chosen.len() > cfg.max_slice_experts.max(1) {
            chosen.sort_by(|&a, &b| {
                expert_value(&remaining[b], cfg).total_cmp(&expert_value(&remaining[a], cfg)).then(a.cmp(&b))
            });
            chosen.truncate(cfg.max_slice_experts.max(1));
            chosen.sort_unstable();
        }
        if chosen.is_empty() {
            break;
        }
        let mut taken = vec![false; remaining.len()];
        for &i in &chosen {
            taken[i] = true;
        }
        let slice_items: Vec<GroupingItem> = chosen.iter().map(|&i| remaining[i]).collect();
        slices.push(make_slice(&slice_items));
        remaining = remaining.iter().zip(&taken).filter(|(_, t)| !**t).map(|(i, _)| *i).collect();
    }
    let fallback_experts = remaining.len();
    slices.extend(aligned_random_grouping(&remaining, available, cfg.max_slice_experts, rng));
    slices.sort_by_key(|s| s.makespan);
    Ok(Grouping { slices, fallback_experts })
}

/// Aligned random grouping: shuffle (seeded), then order by lifespan class (powers of two) so
/// co-running experts have similar lifespans, then fill slices first-fit under `available`
/// bytes and `max_len` experts.
pub fn aligned_random_grouping(
    items: &[GroupingItem],
    available: u64,
    max_len: usize,
    rng: &mut SmallRng,
) -> Vec<TimeSlice> {
    let mut order: Vec<GroupingItem> = items.to_vec();
    order.shuffle(rng);
    order.sort_by_key(|i| 64 - (i.lifespan.0 + 1).leading_zeros());
    let mut bins: Vec<(u64, Vec<GroupingItem>)> = Vec::new();
    for item in order {
        match bins
            .iter_mut()
            .find(|(used, m)| m.len() < max_len.max(1) && used.saturating_add(item.temp_bytes) <= available)
        {
            Some((used, members)) => {
                *used += item.temp_bytes;
                members.push(item);
            }
            None => bins.push((item.temp_bytes, vec![item])),
        }
    }
    let mut slices: Vec<TimeSlice> = bins.iter().map(|(_, m)| make_slice(m)).collect();
    slices.sort_by_key(|s| s.makespan);
    slices
}

/// `M_c - M_s`, or an error when the static part alone does not fit.
fn capacity(cfg: &GroupingConfig) -> Result<u64, GroupingError> {
    cfg.device_budget.checked_sub(cfg.static_bytes).ok_or(GroupingError::StaticExceedsBudget {
        static_bytes: cfg.static_bytes,
        budget: cfg.device_budget,
    })
}

fn make_slice(items: &[GroupingItem]) -> TimeSlice {
    TimeSlice {
        experts: items.iter().map(|i| i.expert).collect(),
        temp_bytes: items.iter().map(|i| i.temp_bytes).sum(),
        makespan: items.iter().map(|i| i.lifespan).max().unwrap_or(Micros::ZERO),
    }
}

/// One 0/1 knapsack round; returns the indices chosen (ascending). Weights are rounded up to
/// whole `unit`s, so a chosen set never exceeds `cells * unit <= M_c - M_s` bytes. Ties keep the
/// smaller set (strict improvement needed to take an item), which keeps results deterministic.
fn knapsack(items: &[GroupingItem], cfg: &GroupingConfig, unit: u64, cells: usize) -> Vec<usize> {
    let n = items.len();
    let weights: Vec<usize> =
        items.iter().map(|i| i.temp_bytes.div_ceil(unit).min(cells as u64 + 1) as usize).collect();
    let values: Vec<f64> = items.iter().map(|i| expert_value(i, cfg)).collect();
    let mut dp = vec![0.0_f64; cells + 1];
    // take[i][j]: item i improved capacity j in round i.
    let mut take = vec![false; n * (cells + 1)];
    for i in 0..n {
        let (w, v) = (weights[i], values[i]);
        if w > cells || v <= 0.0 {
            continue;
        }
        for j in (w..=cells).rev() {
            let cand = dp[j - w] + v;
            if cand > dp[j] + 1e-12 {
                dp[j] = cand;
                take[i * (cells + 1) + j] = true;
            }
        }
    }
    let mut chosen = Vec::new();
    let mut j = cells;
    for i in (0..n).rev() {
        if take[i * (cells + 1) + j] {
            chosen.push(i);
            j -= weights[i];
        }
    }
    chosen.reverse();
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn item(id: u32, bytes: u64, secs: u64) -> GroupingItem {
        GroupingItem { expert: ExpertId(id), temp_bytes: bytes, lifespan: Micros::from_secs(secs) }
    }

    fn cfg(budget: u64, static_bytes: u64, eta: f64) -> GroupingConfig {
        GroupingConfig {
            device_budget: budget,
            static_bytes,
            eta_per_sec: eta,
            max_dp_cells: 4096,
            max_slice_experts: usize::MAX,
        }
    }

    #[test]
    fn hand_solved_knapsack() {
        // M_c = 100, M_s = 10 -> capacity 90; η = 0.05/s.
        // A: w 50, r 1 -> v 0.50 - 0.05 = 0.45     B: w 40, r 4 -> v 0.40 - 0.20 = 0.20
        // C: w 30, r 1 -> v 0.30 - 0.05 = 0.25     D: w 20, r 1 -> v 0.20 - 0.05 = 0.15
        // Round 1 (cap 90): {A,B}=0.65 (90)  {A,C}=0.70 (80)  {A,D}=0.60  {A,C} + D = 100 > 90,
        //   {B,C,D}=0.60 (90), {A,D,..}: A+D+C too big -> best {A,C}, 80 bytes, makespan 1 s.
        // Round 2: {B,D} = 0.35 (60 bytes), makespan 4 s.
        // Pure memory-greedy would pick {A,B} (90 bytes) first and strand the long B with A.
        let items = [item(0, 50, 1), item(1, 40, 4), item(2, 30, 1), item(3, 20, 1)];
        let mut rng = SmallRng::seed_from_u64(1);
        let g = group_experts(&items, &cfg(100, 10, 0.05), &mut rng).unwrap();
        assert_eq!(g.slices.len(), 2);
        assert_eq!(g.slices[0].experts, vec![ExpertId(0), ExpertId(2)]);
        assert_eq!(g.slices[0].temp_bytes, 80);
        assert_eq!(g.slices[1].experts, vec![ExpertId(1), ExpertId(3)]);
        assert_eq!(g.total_latency(), Micros::from_secs(5));
        assert_eq!(g.fallback_experts, 0);
    }

    #[test]
    fn non_positive_values_fall_back_to_aligned_random_grouping() {
        // η so large every value is negative: the DP places nothing, the fallback places all.
        let items = [item(0, 30, 10), item(1, 30, 10), item(2, 30, 1)];
        let mut rng = SmallRng::seed_from_u64(7);
        let g = group_experts(&items, &cfg(100, 0, 1.0), &mut rng).unwrap();
        assert_eq!(g.fallback_experts, 3);
        let placed: usize = g.slices.iter().map(|s| s.experts.len()).sum();
        assert_eq!(placed, 3);
        assert!(g.slices.iter().all(|s| s.temp_bytes <= 100));
    }

    #[test]
    fn errors_name_the_problem() {
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(
            group_experts(&[item(5, 95, 1)], &cfg(100, 10, 0.0), &mut rng),
            Err(GroupingError::ExpertTooLarge { expert: ExpertId(5), need: 95, available: 90 })
        );
        assert!(matches!(
            group_experts(&[], &cfg(10, 11, 0.0), &mut rng),
            Err(GroupingError::StaticExceedsBudget { .. })
        ));
    }

    proptest! {
        #[test]
        fn grouping_never_exceeds_the_budget_and_places_every_expert(
            sizes in proptest::collection::vec((1u64..5_000, 0u64..20), 0..40),
            budget in 5_000u64..20_000,
            static_bytes in 0u64..5_000,
            eta in 0.0f64..0.2,
            cells in 1usize..300,
            max_len in 1usize..50,
            seed in any::<u64>(),
        ) {
            let items: Vec<_> = sizes.iter().enumerate()
                .map(|(i, &(b, s))| item(i as u32, b, s)).collect();
            let cfg = GroupingConfig { device_budget: budget, static_bytes, eta_per_sec: eta, max_dp_cells: cells, max_slice_experts: max_len };
            let mut rng = SmallRng::seed_from_u64(seed);
            match group_experts(&items, &cfg, &mut rng) {
                Ok(g) => {
                    let mut seen: Vec<u32> = g.slices.iter().flat_map(|s| s.experts.iter().map(|e| e.0)).collect();
                    seen.sort_unstable();
                    prop_assert_eq!(seen, (0..items.len() as u32).collect::<Vec<_>>());
                    for s in &g.slices {
                        let sum: u64 = s.experts.iter().map(|e| items[e.0 as usize].temp_bytes).sum();
                        prop_assert_eq!(sum, s.temp_bytes);
                        prop_assert!(sum + static_bytes <= budget);
                        prop_assert!(s.experts.len() <= max_len);
                    }
                    prop_assert!(g.slices.windows(2).all(|w| w[0].makespan <= w[1].makespan));
                }
                Err(GroupingError::ExpertTooLarge { need, available, .. }) => prop_assert!(need > available),
                Err(GroupingError::StaticExceedsBudget { .. }) => prop_assert!(static_bytes > budget),
            }
        }
    }
}
