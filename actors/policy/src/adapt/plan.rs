//! The executor's per-step slice plan (paper §3.2.1 applied to one step of every task in a cycle):
//! which experts' training steps share a time slice under the memory the pool has free.
//!
//! `M_tmp` comes from the [`MemoryModel`] fitted on the pool's own measurements when they determine
//! it, else from the caller's analytic bound; `M_c` is the pool's free bytes and `M_s` the dense
//! workspace a slice needs besides its experts. The knapsack ([`group_experts`]) packs the experts;
//! when it cannot (one expert alone does not fit), the plan falls back to one slice per task with
//! all its experts, the executor's whole-model step. Pure: measurements and the seed come in.
//!
//! Every slice a task appears in costs the executor one forward and backward pass of that task's
//! model on the step's batch (the dense part of the step does not split by expert), so a task
//! whose experts all fit in the free bytes together enters the knapsack as one item, its
//! *bundle* (the sum of its experts' `M_tmp`, the longest lifespan): it is never split over
//! slices. Only a task too large to train whole under `M_c - M_s` has its experts packed one by
//! one. When everything fits, the plan is one slice: the same work as whole-model steps.

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::grouping::{Grouping, GroupingConfig, GroupingError, GroupingItem, group_experts};
use super::memory::{ExpertShape, MAX_FIT_SAMPLES, MemoryModel, MemorySample};
use super::{ExpertId, TaskId};
use crate::Micros;

/// One expert that trains in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanExpert {
    /// The task it belongs to.
    pub task: TaskId,
    /// The expert (unique across tasks).
    pub expert: ExpertId,
    /// Shape of its work: token bound (its capacity) and model width.
    pub shape: ExpertShape,
    /// The analytic bound on its temporary bytes, used while no estimator is fitted.
    pub bound_bytes: u64,
    /// Its estimated runtime in the slice (from measured step times).
    pub lifespan: Micros,
}

/// Memory facts of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanMemory {
    /// `M_c`: bytes the pool has free now.
    pub free_bytes: u64,
    /// `M_s`: the dense workspace a slice reserves besides its experts' temporaries.
    pub workspace_bytes: u64,
    /// The pool's allocation alignment (every temporary is rounded up to it).
    pub align: u64,
    /// `η` of the knapsack value, per second of lifespan.
    pub eta_per_sec: f64,
}

/// Everything the knapsack was given, so a plan can be reproduced.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// The items, in the order given: a bundle per task that fits whole, else one per expert.
    pub items: Vec<GroupingItem>,
    /// The experts each item stands for (by index into `items`): a bundle's are its task's
    /// experts in input order, an unbundled item's is its own expert.
    pub members: Vec<Vec<ExpertId>>,
    /// The knapsack's knobs.
    pub config: GroupingConfig,
    /// Seed of the fallback grouping's RNG.
    pub seed: u64,
}

/// The plan: slices in execution order, each a list of experts.
#[derive(Debug, Clone, PartialEq)]
pub struct SlicePlan {
    /// What the knapsack was given.
    pub input: PlanInput,
    /// The knapsack's grouping, or why there was none (then `slices` is one per task).
    pub grouping: Result<Grouping, GroupingError>,
    /// Experts per slice, in execution order.
    pub slices: Vec<Vec<ExpertId>>,
}

/// Fits `M_tmp = B_p (θ1 T d_k + θ2 T²) + m_f` on the newest [`MAX_FIT_SAMPLES`] measurements
/// (fp32); `None` while they do not determine it (too few, or every token count equal).
pub fn fit_estimator(samples: &[MemorySample]) -> Option<MemoryModel> {
    let from = samples.len().saturating_sub(MAX_FIT_SAMPLES);
    MemoryModel::fit(4.0, &samples[from..]).ok()
}

/// `M_tmp` of one expert, rounded up to the pool's alignment: the estimator's when fitted, else
/// the analytic bound.
pub fn temp_bytes(e: &PlanExpert, estimator: Option<&MemoryModel>, align: u64) -> u64 {
    let raw = estimator.map_or(e.bound_bytes, |m| m.temporary_bytes(e.shape));
    raw.div_ceil(align.max(1)) * align.max(1)
}

/// Plans one step's slices (see the module doc). `experts` are grouped by task in input order.
pub fn plan_slices(
    experts: &[PlanExpert],
    estimator: Option<&MemoryModel>,
    memory: PlanMemory,
    seed: u64,
) -> SlicePlan {
    let available = memory.free_bytes.saturating_sub(memory.workspace_bytes);
    let (items, members) = bundle_tasks(experts, estimator, memory.align, available);
    let config = GroupingConfig {
        device_budget: memory.free_bytes,
        static_bytes: memory.workspace_bytes,
        eta_per_sec: memory.eta_per_sec,
        max_dp_cells: 1024,
        max_slice_experts: usize::MAX,
    };
    let grouping = group_experts(&items, &config, &mut SmallRng::seed_from_u64(seed));
    let input = PlanInput { items, members, config, seed };
    let slices = match &grouping {
        Ok(g) => g.slices.iter().map(|s| input.expand(&s.experts)).collect(),
        Err(_) => per_task(experts),
    };
    SlicePlan { input, grouping, slices }
}

impl PlanInput {
    /// The experts a slice of items (by their `expert` ids) stands for, bundles expanded, in
    /// the slice's order.
    pub fn expand(&self, slice: &[ExpertId]) -> Vec<ExpertId> {
        slice
            .iter()
            .flat_map(|id| match self.items.iter().position(|i| i.expert == *id) {
                Some(k) => self.members[k].clone(),
                None => vec![*id],
            })
            .collect()
    }
}

/// The knapsack's items (see the module doc): per task in first-appearance order, one bundle
/// (named by its first expert) when its experts' aligned `M_tmp` sum to at most `available`,
/// else one item per expert; and the experts each item stands for.
fn bundle_tasks(
    experts: &[PlanExpert],
    estimator: Option<&MemoryModel>,
    align: u64,
    available: u64,
) -> (Vec<GroupingItem>, Vec<Vec<ExpertId>>) {
    let mut tasks: Vec<(TaskId, Vec<GroupingItem>)> = Vec::new();
    for e in experts {
        let item = GroupingItem {
            expert: e.expert,
            temp_bytes: temp_bytes(e, estimator, align),
            lifespan: e.lifespan,
        };
        match tasks.iter_mut().find(|(t, _)| *t == e.task) {
            Some((_, v)) => v.push(item),
            None => tasks.push((e.task, vec![item])),
        }
    }
    let (mut items, mut members) = (Vec::new(), Vec::new());
    for (_, its) in tasks {
        let total = its.iter().map(|i| i.temp_bytes).fold(0u64, u64::saturating_add);
        match its.first() {
            Some(first) if its.len() > 1 && total <= available => {
                let lifespan = its.iter().map(|i| i.lifespan).max().unwrap_or(first.lifespan);
                items.push(GroupingItem { expert: first.expert, temp_bytes: total, lifespan });
                members.push(its.iter().map(|i| i.expert).collect());
            }
            _ => {
                members.extend(its.iter().map(|i| vec![i.expert]));
                items.extend(its);
            }
        }
    }
    (items, members)
}

/// Bytes a step needs free for the largest task of `experts` to train whole (its bundle, never
/// split over slices): the workspace plus its experts' aligned `M_tmp` (see [`temp_bytes`]).
/// What the executor makes room for before planning ([`super::evict::make_room`]).
pub fn whole_task_bytes(
    experts: &[PlanExpert],
    estimator: Option<&MemoryModel>,
    workspace_bytes: u64,
    align: u64,
) -> u64 {
    let mut per_task: Vec<(TaskId, u64)> = Vec::new();
    for e in experts {
        let b = temp_bytes(e, estimator, align);
        match per_task.iter_mut().find(|(t, _)| *t == e.task) {
            Some((_, v)) => *v = v.saturating_add(b),
            None => per_task.push((e.task, b)),
        }
    }
    workspace_bytes.saturating_add(per_task.iter().map(|(_, b)| *b).max().unwrap_or(0))
}

/// One slice per task holding all its experts, tasks in first-appearance order.
fn per_task(experts: &[PlanExpert]) -> Vec<Vec<ExpertId>> {
    let mut out: Vec<(TaskId, Vec<ExpertId>)> = Vec::new();
    for e in experts {
        match out.iter_mut().find(|(t, _)| *t == e.task) {
            Some((_, v)) => v.push(e.expert),
            None => out.push((e.task, vec![e.expert])),
        }
    }
    out.into_iter().map(|(_, v)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(task: u32, id: u32, tokens: u64, bound: u64) -> PlanExpert {
        PlanExpert {
            task: TaskId(task),
            expert: ExpertId(id),
            shape: ExpertShape { tokens, d_k: 16 },
            bound_bytes: bound,
            lifespan: Micros(1000),
        }
    }

    fn mem(free: u64, workspace: u64) -> PlanMemory {
        PlanMemory { free_bytes: free, workspace_bytes: workspace, align: 256, eta_per_sec: 0.01 }
    }

    #[test]
    fn without_an_estimator_the_bound_is_used_and_packed_under_the_free_bytes() {
        // Four experts of 1000 B (1024 aligned), 3000 B free, 900 B workspace: 2100 B for experts.
        // Each task's two experts (2048 B) fit whole: one bundle per task, one slice per task.
        let xs = [e(0, 0, 10, 1000), e(0, 1, 10, 1000), e(1, 2, 10, 1000), e(1, 3, 10, 1000)];
        let p = plan_slices(&xs, None, mem(3000, 900), 1);
        assert_eq!(p.input.items.iter().map(|i| i.temp_bytes).collect::<Vec<_>>(), [2048, 2048]);
        assert_eq!(p.input.members, [vec![ExpertId(0), ExpertId(1)], vec![ExpertId(2), ExpertId(3)]]);
        let mut got = p.slices.clone();
        got.sort();
        assert_eq!(got, [vec![ExpertId(0), ExpertId(1)], vec![ExpertId(2), ExpertId(3)]]);
        let g = p.grouping.as_ref().unwrap();
        assert_eq!(p.slices, g.slices.iter().map(|s| p.input.expand(&s.experts)).collect::<Vec<_>>());
    }

    #[test]
    fn when_everything_fits_the_plan_is_one_slice() {
        let xs = [e(0, 0, 10, 1000), e(0, 1, 10, 1000), e(1, 2, 10, 1000), e(1, 3, 10, 1000)];
        let p = plan_slices(&xs, None, mem(10_000, 900), 1);
        assert_eq!(p.slices.len(), 1);
        let mut all = p.slices[0].clone();
        all.sort();
        assert_eq!(all, [ExpertId(0), ExpertId(1), ExpertId(2), ExpertId(3)]);
    }

    #[test]
    fn a_task_too_large_to_train_whole_is_split_by_expert_and_the_others_stay_whole() {
        // Task 0: three experts (3072 B) over the 2100 B available, so packed one by one; task 1's
        // two (2048 B) fit whole and stay in one slice.
        let xs =
            [e(0, 0, 10, 1000), e(0, 1, 10, 1000), e(0, 4, 10, 1000), e(1, 2, 10, 1000), e(1, 3, 10, 1000)];
        let p = plan_slices(&xs, None, mem(3000, 900), 1);
        assert_eq!(p.input.items.len(), 4);
        let with_task1: Vec<_> = p.slices.iter().filter(|s| s.contains(&ExpertId(2))).collect();
        assert_eq!(with_task1.len(), 1);
        assert!(with_task1[0].contains(&ExpertId(3)));
        let task0_slices = p.slices.iter().filter(|s| s.iter().any(|x| [0, 1, 4].contains(&x.0))).count();
        assert!(task0_slices >= 2, "{:?}", p.slices);
        assert_eq!(p.slices.iter().map(Vec::len).sum::<usize>(), 5);
    }

    #[test]
    fn a_fitted_estimator_replaces_the_bound() {
        // Measured bytes = 100 T + 512: the fit recovers it, so 10 tokens -> 1512 -> 1536 aligned.
        let samples: Vec<MemorySample> = [2u64, 5, 9, 14]
            .iter()
            .map(|&t| MemorySample {
                shape: ExpertShape { tokens: t, d_k: 16 },
                measured_bytes: (100 * t + 512) as f64,
            })
            .collect();
        let m = fit_estimator(&samples).unwrap();
        assert_eq!(temp_bytes(&e(0, 0, 10, 99_999), Some(&m), 256), 1536);
        // Equal token counts do not determine it.
        assert!(fit_estimator(&[samples[0]; 5]).is_none());
    }

    #[test]
    fn whole_task_bytes_is_the_workspace_and_the_largest_bundle() {
        // Task 0: 1024 + 1024 aligned; task 1: 5120 aligned; workspace 900.
        let xs = [e(0, 0, 10, 1000), e(0, 1, 10, 1000), e(1, 2, 10, 5000)];
        assert_eq!(whole_task_bytes(&xs, None, 900, 256), 900 + 5120);
        // With that much free every task is a bundle: no task is split over slices.
        let p = plan_slices(&xs, None, mem(900 + 5120, 900), 1);
        assert_eq!(p.input.items.len(), 2);
        assert_eq!(whole_task_bytes(&[], None, 900, 256), 900);
    }

    #[test]
    fn an_expert_too_large_falls_back_to_one_slice_per_task() {
        let xs = [e(3, 0, 10, 1000), e(3, 1, 10, 1000), e(4, 2, 10, 5000)];
        let p = plan_slices(&xs, None, mem(3000, 0), 1);
        assert!(matches!(p.grouping, Err(GroupingError::ExpertTooLarge { .. })));
        assert_eq!(p.slices, vec![vec![ExpertId(0), ExpertId(1)], vec![ExpertId(2)]]);
    }
}
