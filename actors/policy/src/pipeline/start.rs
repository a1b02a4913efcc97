//! Start plan: each worker's stages for a streaming job, chosen at the job's start by replaying
//! each candidate on the predicted costs, so that every worker loads its first stage at once.
//!
//! The steady-state plan ([`super::plan`]) balances stage rates with a fluid estimate, made once
//! workers hold stages; at the start of a short job there is no steady state: a pipeline fills
//! and drains, and the loads (each worker one stage, at its own speed) are a large part of the
//! job. So the start plan gives each worker `w` a home `h(w)` and a next stage `t(w) >= h(w)`
//! (`t(w) = h(w)`: it stays), and replays each plan as a pipeline on the predicted costs: `w`
//! first makes `h(w)` live (`L_w(h(w))`, 0 if it is live); once every task of its live stage is
//! claimed it loads `t(w)` (a stage upstream is all claimed by then, so `t(w) >= h(w)`); of the
//! tasks whose upstream is done, the one that would end first runs next (inputs in order within
//! a stage), each taking `tau_w(k)`. A worker that moves on is what a short job needs when a
//! stage is cheap to run but costly to load (MiniLM's embedding gather: the fast worker runs all
//! of it in a few ms, then helps downstream) or when stages outnumber the ways to balance them
//! with one stage each. The plan with the least replayed makespan wins; ties go to fewer moves
//! on, then to fewer workers moved off their live stage, then to the lexicographically smallest
//! plan, so the result is deterministic. A plan that leaves a stage without a worker, or gives a
//! worker a stage that does not fit, is never chosen.
//!
//! The replay is `O(N S W)` per plan, and there are `(S (S + 1) / 2)^W` plans; past
//! [`MAX_REPLAY_STEPS`] steps over all of them only the plans where every worker stays are
//! replayed (`S^W`), and past that too there is no start plan (the steady-state plan takes over
//! once workers hold stages). A replay stops as soon as it is past the best so far.

use super::plan::PlanWorker;

/// Most replay steps (tasks x workers, summed over the plans) one start plan may take.
pub const MAX_REPLAY_STEPS: usize = 20_000_000;

/// A start plan: per worker (in the order given), its home and the stage it moves on to once its
/// home is all claimed (its home again when it stays).
#[derive(Clone, Debug, PartialEq)]
pub struct StartPlan {
    /// The stage each worker loads at the start.
    pub homes: Vec<usize>,
    /// The stage each worker loads once every task of its home is claimed (`>=` its home).
    pub then: Vec<usize>,
    /// The replayed makespan, µs.
    pub makespan_us: f64,
    /// Tasks each worker runs in the replay: one that runs none need not load anything.
    pub runs: Vec<usize>,
}

/// The replayed makespan of homes `homes` and next stages `then` over `inputs` inputs, µs
/// (`+inf` when a stage has no worker, a worker's stage does not fit or has no finite cost, or
/// the replay passes `cutoff`).
pub fn replay(workers: &[PlanWorker], homes: &[usize], then: &[usize], inputs: usize, cutoff: f64) -> f64 {
    replay_counting(workers, homes, then, inputs, cutoff, &mut [])
}

/// [`replay`], counting the tasks each worker runs into `runs` (when it has one slot per worker).
fn replay_counting(
    workers: &[PlanWorker],
    homes: &[usize],
    then: &[usize],
    inputs: usize,
    cutoff: f64,
    runs: &mut [usize],
) -> f64 {
    let s = workers.first().map_or(0, |w| w.task_us.len());
    let priced = |w: &PlanWorker, k: usize| {
        matches!((w.task_us.get(k), w.load_us.get(k)), (Some(&t), Some(&l))
            if t.is_finite() && t > 0.0 && l.is_finite() && l >= 0.0)
            && w.fits.get(k).copied().unwrap_or(false)
    };
    if s == 0
        || homes.len() != workers.len()
        || then.len() != workers.len()
        || (0..s).any(|k| !homes.contains(&k) && !then.contains(&k))
        || workers
            .iter()
            .zip(homes.iter().zip(then))
            .any(|(w, (&h, &t))| !priced(w, h) || !priced(w, t) || t < h || (t != h && w.live == Some(t)))
    {
        return f64::INFINITY;
    }
    let mut free: Vec<f64> = workers.iter().zip(homes).map(|(w, &h)| w.load_us[h]).collect();
    let mut live = homes.to_vec();
    // done[k]: end of stage k for inputs 0..next[k], in input order
    let mut done: Vec<Vec<f64>> = vec![Vec::with_capacity(inputs); s];
    let mut end = 0.0f64;
    for _ in 0..inputs * s {
        let mut pick: Option<(f64, usize)> = None;
        for (i, w) in workers.iter().enumerate() {
            if done[live[i]].len() >= inputs && then[i] != live[i] {
                live[i] = then[i];
                free[i] += w.load_us[then[i]];
            }
            let k = live[i];
            let next = done[k].len();
            if next >= inputs {
                continue;
            }
            let ready = if k == 0 {
                0.0
            } else {
                match done[k - 1].get(next) {
                    Some(&d) => d,
                    None => continue,
                }
            };
            let finish = free[i].max(ready) + w.task_us[k];
            if pick.is_none_or(|(f, _)| finish < f) {
                pick = Some((finish, i));
            }
        }
        let Some((finish, i)) = pick else { return f64::INFINITY };
        free[i] = finish;
        done[live[i]].push(finish);
        if let Some(r) = runs.get_mut(i) {
            *r += 1;
        }
        end = end.max(finish);
        if end > cutoff {
            return f64::INFINITY;
        }
    }
    end
}

/// The plan with the least [`replay`] makespan, `None` when there are no workers or stages, the
/// search is too large, or no plan covers every stage.
pub fn start_plan(workers: &[PlanWorker], inputs: usize) -> Option<StartPlan> {
    let s = workers.first().map_or(0, |w| w.task_us.len());
    let w = workers.len();
    if s == 0 || w == 0 || inputs == 0 {
        return None;
    }
    let per_plan = inputs.checked_mul(s)?.checked_mul(w)?;
    let count = |choices: usize| (0..w).try_fold(1usize, |acc, _| acc.checked_mul(choices));
    let within = |plans: Option<usize>| {
        plans.and_then(|p| p.checked_mul(per_plan)).is_some_and(|n| n <= MAX_REPLAY_STEPS)
    };
    // each worker's (home, then) choices: with moves on, every then >= home; else then = home
    let pairs: Vec<(usize, usize)> = if within(count(s * (s + 1) / 2)) {
        (0..s).flat_map(|h| (h..s).map(move |t| (h, t))).collect()
    } else if within(count(s)) {
        (0..s).map(|h| (h, h)).collect()
    } else {
        return None;
    };
    let total = count(pairs.len())?;
    let moved =
        |homes: &[usize]| workers.iter().zip(homes).filter(|(w, h)| w.live.is_some_and(|l| l != **h)).count();
    // the best so far, and its tie-break key: (moves on, workers moved off their live stage)
    let mut best: Option<(StartPlan, (usize, usize))> = None;
    // Workers alike in every input are interchangeable: of the plans that permute their choices
    // only the one with their choices in order is replayed (it is also the smallest, so the
    // tie-break picks the same plan as a full search).
    let twin_of: Vec<Option<usize>> =
        (0..w).map(|i| (0..i).rev().find(|&j| workers[j] == workers[i])).collect();
    let (mut homes, mut then, mut choice) = (vec![0usize; w], vec![0usize; w], vec![0usize; w]);
    for code in 0..total {
        let mut c = code;
        for i in (0..w).rev() {
            choice[i] = c % pairs.len();
            (homes[i], then[i]) = pairs[choice[i]];
            c /= pairs.len();
        }
        if twin_of.iter().enumerate().any(|(i, t)| t.is_some_and(|j| choice[j] > choice[i])) {
            continue;
        }
        let cutoff = best.as_ref().map_or(f64::INFINITY, |b| b.0.makespan_us * (1.0 + 1e-9));
        let cost = replay(workers, &homes, &then, inputs, cutoff);
        if !cost.is_finite() {
            continue;
        }
        let key = (homes.iter().zip(&then).filter(|(h, t)| h != t).count(), moved(&homes));
        let better = match &best {
            None => true,
            Some((b, bk)) => {
                cost < b.makespan_us * (1.0 - 1e-9)
                    || (cost <= b.makespan_us * (1.0 + 1e-9)
                        && (key, &homes, &then) < (*bk, &b.homes, &b.then))
            }
        };
        if better {
            best = Some((
                StartPlan { homes: homes.clone(), then: then.clone(), makespan_us: cost, runs: Vec::new() },
                key,
            ));
        }
    }
    best.map(|(mut plan, _)| {
        plan.runs = vec![0; w];
        replay_counting(workers, &plan.homes, &plan.then, inputs, f64::INFINITY, &mut plan.runs);
        plan
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(task: &[f64], load: &[f64]) -> PlanWorker {
        PlanWorker {
            task_us: task.to_vec(),
            load_us: load.to_vec(),
            fits: vec![true; task.len()],
            live: None,
        }
    }

    fn plan(homes: &[usize], then: &[usize], makespan_us: f64, runs: &[usize]) -> StartPlan {
        StartPlan { homes: homes.to_vec(), then: then.to_vec(), makespan_us, runs: runs.to_vec() }
    }

    /// Two stages on two equal workers, by hand: loads 10, tasks 5 and 7; three inputs. The
    /// pipeline (stage 0 on one, stage 1 on the other) ends at 10 + 5 + 3 x 7 = 36; the stage-0
    /// worker moving on (its three tasks end at 25, its load of stage 1 at 35) gains nothing, so
    /// it stays.
    #[test]
    fn replay_of_a_two_stage_pipeline_by_hand() {
        let w = [worker(&[5.0, 7.0], &[10.0, 10.0]), worker(&[5.0, 7.0], &[10.0, 10.0])];
        assert_eq!(replay(&w, &[0, 1], &[0, 1], 3, f64::INFINITY), 36.0);
        assert_eq!(replay(&w, &[0, 1], &[1, 1], 3, f64::INFINITY), 36.0);
        assert_eq!(replay(&w, &[0, 1], &[0, 1], 3, 30.0), f64::INFINITY, "past the cutoff");
        assert_eq!(replay(&w, &[0, 0], &[0, 0], 3, f64::INFINITY), f64::INFINITY, "stage 1 has no worker");
        assert_eq!(replay(&w, &[1, 1], &[1, 1], 3, f64::INFINITY), f64::INFINITY, "stage 0 has no worker");
        assert_eq!(start_plan(&w, 3), Some(plan(&[0, 1], &[0, 1], 36.0, &[3, 3])));
    }

    /// A stage cheap to run but costly to load (MiniLM's embedding gather) on the fast worker,
    /// which then moves on to the heavy stage, by hand: the fast one loads stage 0 (100), runs
    /// the five inputs' stage 0 (2 each, until 110), loads stage 1 (100, until 210) and runs all
    /// five (40 each): 410. The slow one's first task would end later than the fast one's, so it
    /// runs none. Each holding one stage: the slow one on stage 0 ends the first input's at 306,
    /// and the fast one on stage 1 runs each as it arrives: 306 + 5 x 40 = 506.
    #[test]
    fn the_fast_worker_runs_the_cheap_stage_then_the_heavy_one() {
        let fast = worker(&[2.0, 40.0], &[100.0, 100.0]);
        let slow = worker(&[6.0, 120.0], &[300.0, 300.0]);
        let w = [fast.clone(), slow.clone()];
        assert!((replay(&w, &[1, 0], &[1, 0], 5, f64::INFINITY) - (300.0 + 6.0 + 5.0 * 40.0)).abs() < 1e-9);
        // the slow one runs nothing: on stage 0 or 1 alike (ties go to the smaller plan)
        assert_eq!(start_plan(&w, 5), Some(plan(&[0, 0], &[1, 0], 410.0, &[10, 0])));
        let mut tight = fast;
        tight.fits = vec![true, false];
        assert_eq!(
            start_plan(&[tight, slow], 5).map(|p| (p.homes, p.then)),
            Some((vec![0, 1], vec![0, 1])),
            "stage 1 does not fit"
        );
    }

    /// A worker does not move on to the stage it holds live: the replay could not price the
    /// reload (its load is given as 0).
    #[test]
    fn no_move_back_to_a_live_stage() {
        let mut w = [worker(&[5.0, 7.0], &[10.0, 10.0]), worker(&[5.0, 7.0], &[10.0, 10.0])];
        w[0].live = Some(1);
        w[0].load_us[1] = 0.0;
        assert_eq!(replay(&w, &[0, 1], &[1, 1], 3, f64::INFINITY), f64::INFINITY);
    }

    /// Workers alike are searched once per set of choices: the plan found has the same makespan
    /// as a search where no two workers are alike (one slower by a hair), and it puts the twins'
    /// choices in order.
    #[test]
    fn twins_are_searched_once_and_the_result_is_the_same() {
        let fast = worker(&[2.0, 40.0, 30.0], &[100.0, 120.0, 110.0]);
        let slow = worker(&[6.0, 120.0, 90.0], &[300.0, 360.0, 330.0]);
        let twins = [fast.clone(), slow.clone(), slow.clone(), fast.clone()];
        let mut apart = twins.clone();
        apart[2].task_us[1] += 1e-6;
        apart[3].task_us[1] += 1e-6;
        for n in [1, 4, 10] {
            let (a, b) = (start_plan(&twins, n).unwrap(), start_plan(&apart, n).unwrap());
            assert!((a.makespan_us - b.makespan_us).abs() < 1e-3, "N = {n}: {a:?} vs {b:?}");
            let pair = |p: &StartPlan, i: usize| (p.homes[i], p.then[i]);
            assert!(pair(&a, 0) <= pair(&a, 3) && pair(&a, 1) <= pair(&a, 2), "N = {n}: {a:?}");
        }
    }

    #[test]
    fn too_large_or_empty_searches_give_no_plan() {
        let w = vec![worker(&[1.0; 4], &[1.0; 4]); 12];
        assert_eq!(start_plan(&w, 10), None);
        assert_eq!(start_plan(&[], 10), None);
        assert_eq!(start_plan(&w[..2], 0), None);
    }
}
