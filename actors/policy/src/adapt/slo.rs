//! SLO-aware ordering for adaptation tasks that carry a deadline (the SLO: a target gain within a
//! latency of arrival). On a processor that tasks share, the order that meets the most deadlines
//! is Moore–Hodgson's: earliest deadline first, and whenever the running schedule misses a
//! deadline, the longest task so far leaves for the end (it is late whatever happens, and taking
//! it out helps every task behind it). The twin-buffer scheduler serves the tasks this keeps
//! on time first ([`super::twin`]); the late ones still train, after them.
//!
//! Pure: the work estimates and `now` come from the caller.

use super::TaskId;
use crate::Micros;

/// One live task as the SLO order sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SloTask {
    /// The task.
    pub id: TaskId,
    /// Latest completion that meets its SLO (`None`: no SLO, served after every task with one).
    pub deadline: Option<Micros>,
    /// Predicted processor time it still needs when it runs alone.
    pub work: Micros,
}

/// The order that meets the most deadlines, as `(on_time, late)`: `on_time` in deadline order
/// (every one finishes by its deadline if they run one after another from `now`), then the tasks
/// without a deadline in the order given; `late` (tasks that would make others miss, or miss
/// anyway) shortest first.
pub fn moore_hodgson(now: Micros, tasks: &[SloTask]) -> (Vec<TaskId>, Vec<TaskId>) {
    let mut edf: Vec<&SloTask> = tasks.iter().filter(|t| t.deadline.is_some()).collect();
    edf.sort_by_key(|t| (t.deadline, t.id));
    let mut kept: Vec<&SloTask> = Vec::with_capacity(edf.len());
    let mut late: Vec<&SloTask> = Vec::new();
    let mut end = now;
    for t in edf {
        kept.push(t);
        end = end + t.work;
        if t.deadline.is_some_and(|d| end > d) {
            // Drop the longest kept task (the latest deadline among equals).
            let i = kept
                .iter()
                .enumerate()
                .max_by_key(|(_, k)| (k.work, k.deadline, k.id))
                .map_or(kept.len() - 1, |(i, _)| i);
            let longest = kept.remove(i);
            end = end.saturating_sub(longest.work);
            late.push(longest);
        }
    }
    late.sort_by_key(|t| (t.work, t.deadline, t.id));
    let on_time =
        kept.iter().map(|t| t.id).chain(tasks.iter().filter(|t| t.deadline.is_none()).map(|t| t.id));
    (on_time.collect(), late.iter().map(|t| t.id).collect())
}

/// How many of `order`'s leading tasks may share the next cycle. A cycle of `n` tasks gives each
/// `1/n` of the processor (the work estimates come from co-run cycles, so a device that runs
/// them in parallel shows it as less work), so a member with work `w` ends near `now + n w`. The
/// largest `n <= seats` that keeps on time every member that would be on time alone; at least 1.
/// Tasks that would miss their deadline even alone share a cycle only with each other: beside
/// one that can still make it they would only slow it down (and the work estimates of tasks not
/// yet measured are medians, so "on time while sharing" is a guess that sharing makes worse).
pub fn cycle_size(now: Micros, order: &[SloTask], seats: usize) -> usize {
    let on_time_alone = |t: &SloTask, start: Micros| t.deadline.is_none_or(|d| start + t.work <= d);
    let head_on_time = order.first().is_none_or(|t| on_time_alone(t, now));
    let mut best = 1;
    for n in 2..=seats.min(order.len()) {
        let fits = order[..n].iter().all(|t| {
            let shared = now + Micros(t.work.0.saturating_mul(n as u64));
            on_time_alone(t, now) == head_on_time && (!head_on_time || t.deadline.is_none_or(|d| shared <= d))
        });
        if !fits {
            break;
        }
        best = n;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: u32, deadline: Option<u64>, work: u64) -> SloTask {
        SloTask { id: TaskId(id), deadline: deadline.map(Micros), work: Micros(work) }
    }

    fn ids(v: &[TaskId]) -> Vec<u32> {
        v.iter().map(|t| t.0).collect()
    }

    #[test]
    fn earliest_deadline_first_when_all_fit() {
        let (on, late) = moore_hodgson(Micros(0), &[t(1, Some(30), 10), t(2, Some(10), 10), t(3, None, 5)]);
        assert_eq!((ids(&on), ids(&late)), (vec![2, 1, 3], vec![]));
    }

    #[test]
    fn the_longest_task_leaves_so_the_rest_make_it() {
        // EDF alone: 1 ends at 5, 2 (long) at 25 > 20, 3 at 30, 4 at 35: three on time at most
        // by dropping 2; FIFO-like serving would miss 2, 3 and 4.
        let tasks = [t(1, Some(10), 5), t(2, Some(20), 20), t(3, Some(30), 5), t(4, Some(35), 5)];
        let (on, late) = moore_hodgson(Micros(0), &tasks);
        assert_eq!((ids(&on), ids(&late)), (vec![1, 3, 4], vec![2]));
    }

    #[test]
    fn late_tasks_come_shortest_first_and_now_counts() {
        let tasks = [t(1, Some(10), 8), t(2, Some(11), 9), t(3, Some(12), 3)];
        // From now = 5 only one of them fits; the longest ones leave, shortest first.
        let (on, late) = moore_hodgson(Micros(5), &tasks);
        assert_eq!((ids(&on), ids(&late)), (vec![3], vec![1, 2]));
    }

    #[test]
    fn moore_hodgson_meets_as_many_deadlines_as_any_order_by_brute_force() {
        use rand::rngs::SmallRng;
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(11);
        for _ in 0..300 {
            let n = rng.random_range(1..7);
            let tasks: Vec<SloTask> =
                (0..n).map(|i| t(i, Some(rng.random_range(1..40)), rng.random_range(1..15))).collect();
            let met = |order: &[SloTask]| {
                let mut end = 0;
                order
                    .iter()
                    .filter(|t| {
                        end += t.work.0;
                        t.deadline.is_some_and(|d| end <= d.0)
                    })
                    .count()
            };
            let (on, _) = moore_hodgson(Micros(0), &tasks);
            let chosen: Vec<SloTask> = on.iter().map(|id| tasks[id.0 as usize]).collect();
            assert_eq!(met(&chosen), chosen.len(), "every on-time task meets its deadline");
            let mut perm = tasks.clone();
            let mut best = 0;
            for _ in 0..400 {
                perm.shuffle(&mut rng);
                best = best.max(met(&perm));
            }
            assert!(chosen.len() >= best, "{tasks:?}: {} < {best}", chosen.len());
        }
    }

    #[test]
    fn a_cycle_grows_only_while_its_members_stay_on_time() {
        let order = [t(1, Some(100), 30), t(2, Some(200), 30), t(3, Some(100), 10)];
        // Two share: 1 ends near 60 <= 100, 2 near 60; three: 1 near 90, 3 near 30: all fit.
        assert_eq!(cycle_size(Micros(0), &order, 4), 3);
        // A tight head keeps the cycle to itself.
        let tight = [t(1, Some(40), 30), t(2, Some(200), 30)];
        assert_eq!(cycle_size(Micros(0), &tight, 4), 1);
        // Late tasks share only with late tasks, up to the seats.
        let hopeless = [t(1, Some(10), 30), t(2, Some(20), 30), t(3, Some(5), 30)];
        assert_eq!(cycle_size(Micros(0), &hopeless, 2), 2);
        assert_eq!(cycle_size(Micros(0), &hopeless, 4), 3);
        let mixed = [t(1, Some(10), 30), t(2, Some(200), 30), t(3, None, 30)];
        assert_eq!(cycle_size(Micros(0), &mixed, 4), 1);
        // An on-time head does not take a late task along, even with room to spare.
        let behind = [t(1, Some(200), 30), t(2, Some(200), 30), t(3, Some(10), 30)];
        assert_eq!(cycle_size(Micros(0), &behind, 4), 2);
        assert_eq!(cycle_size(Micros(0), &[], 4), 1);
    }
}
