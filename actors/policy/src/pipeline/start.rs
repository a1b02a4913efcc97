//! Start plan: the home stage of each worker for a streaming job, chosen at the job's start by
//! replaying each candidate on the predicted costs, so that every worker loads its stage at once.
//!
//! The steady-state plan ([`super::plan`]) balances stage rates with a fluid estimate, made once
//! workers hold stages; at the start of a short job there is no steady state: a pipeline fills
//! and drains, and the loads (each worker one stage, at its own speed) are a large part of the
//! job. So the start plan replays each plan `h` (every worker one stage, `S^W` of them) as a
//! static pipeline on the predicted costs: worker `w` first makes `h(w)` live (`L_w(h(w))`, 0 if
//! it is live), then, of the tasks whose upstream is done, the one that would end first runs
//! next (inputs in order within a stage), each taking `tau_w(k)`. The plan with the least
//! replayed makespan wins; ties go to fewer workers moved off their live stage, then to the
//! lexicographically smallest plan, so the result is deterministic. A plan that leaves a stage
//! without a worker, or puts a worker on a stage that does not fit, is never chosen.
//!
//! The replay is `O(N S W)` per plan; past [`MAX_REPLAY_STEPS`] steps over all plans there is no
//! start plan (the steady-state plan takes over once workers hold stages).

use super::plan::PlanWorker;

/// Most replay steps (tasks x workers, summed over the plans) one start plan may take.
pub const MAX_REPLAY_STEPS: usize = 20_000_000;

/// The replayed makespan of `plan` over `inputs` inputs, µs (`+inf` when a stage has no worker
/// or a worker's stage does not fit or has no finite cost).
pub fn replay(workers: &[PlanWorker], plan: &[usize], inputs: usize) -> f64 {
    let s = workers.first().map_or(0, |w| w.task_us.len());
    if s == 0 || plan.len() != workers.len() || (0..s).any(|k| !plan.contains(&k)) {
        return f64::INFINITY;
    }
    let mut free = Vec::with_capacity(workers.len());
    for (w, &k) in workers.iter().zip(plan) {
        let (Some(&t), Some(&l)) = (w.task_us.get(k), w.load_us.get(k)) else {
            return f64::INFINITY;
        };
        if !(t.is_finite() && t > 0.0 && l.is_finite() && l >= 0.0 && w.fits.get(k).copied().unwrap_or(false))
        {
            return f64::INFINITY;
        }
        free.push(l);
    }
    // done[k]: end of stage k for inputs 0..next[k], in input order
    let mut done: Vec<Vec<f64>> = vec![Vec::with_capacity(inputs); s];
    let mut end = 0.0f64;
    for _ in 0..inputs * s {
        let mut pick: Option<(f64, usize)> = None;
        for (i, (w, &k)) in workers.iter().zip(plan).enumerate() {
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
        done[plan[i]].push(finish);
        end = end.max(finish);
    }
    end
}

/// The plan with the least [`replay`] makespan and that makespan, `None` when there are no
/// workers or stages, the search is too large, or no plan covers every stage.
pub fn start_plan(workers: &[PlanWorker], inputs: usize) -> Option<(Vec<usize>, f64)> {
    let s = workers.first().map_or(0, |w| w.task_us.len());
    let w = workers.len();
    if s == 0 || w == 0 || inputs == 0 {
        return None;
    }
    let per_plan = inputs.checked_mul(s)?.checked_mul(w)?;
    let total = (0..w).try_fold(1usize, |acc, _| acc.checked_mul(s))?;
    if total.checked_mul(per_plan)? > MAX_REPLAY_STEPS {
        return None;
    }
    let moved = |p: &[usize]| workers.iter().zip(p).filter(|(w, h)| w.live.is_some_and(|l| l != **h)).count();
    let mut best: Option<(f64, usize, Vec<usize>)> = None;
    let mut plan = vec![0usize; w];
    for code in 0..total {
        let mut c = code;
        for slot in plan.iter_mut().rev() {
            *slot = c % s;
            c /= s;
        }
        let cost = replay(workers, &plan, inputs);
        if !cost.is_finite() {
            continue;
        }
        let m = moved(&plan);
        let better = match &best {
            None => true,
            Some((bc, bm, bp)) => {
                cost < *bc * (1.0 - 1e-9) || (cost <= *bc * (1.0 + 1e-9) && (m, &plan) < (*bm, bp))
            }
        };
        if better {
            best = Some((cost, m, plan.clone()));
        }
    }
    best.map(|(c, _, p)| (p, c))
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

    /// Two stages on two equal workers, by hand: loads 10, tasks 5 and 7; three inputs. The
    /// pipeline (stage 0 on one, stage 1 on the other) ends at 10 + 5 + 3 x 7 = 36.
    #[test]
    fn replay_of_a_two_stage_pipeline_by_hand() {
        let w = [worker(&[5.0, 7.0], &[10.0, 10.0]), worker(&[5.0, 7.0], &[10.0, 10.0])];
        assert_eq!(replay(&w, &[0, 1], 3), 36.0);
        assert_eq!(replay(&w, &[0, 0], 3), f64::INFINITY, "stage 1 has no worker");
        assert_eq!(start_plan(&w, 3), Some((vec![0, 1], 36.0)));
    }

    /// A slow worker with a costly load is better put on the cheap stage than made the only
    /// holder of an expensive one, and the fast one takes the heavy stage.
    #[test]
    fn the_fast_worker_takes_the_heavy_stage() {
        let fast = worker(&[2.0, 40.0], &[100.0, 100.0]);
        let slow = worker(&[6.0, 120.0], &[300.0, 300.0]);
        let (plan, cost) = start_plan(&[fast.clone(), slow.clone()], 5).unwrap();
        assert_eq!(plan, vec![1, 0]);
        // the slow one: 300 + 6 per input; the fast one starts each at the input's arrival
        assert!((cost - (300.0 + 6.0 + 5.0 * 40.0)).abs() < 1e-9, "{cost}");
        let mut tight = fast;
        tight.fits = vec![true, false];
        assert_eq!(start_plan(&[tight, slow], 5).map(|p| p.0), Some(vec![0, 1]), "stage 1 does not fit");
    }

    #[test]
    fn too_large_or_empty_searches_give_no_plan() {
        let w = vec![worker(&[1.0; 4], &[1.0; 4]); 12];
        assert_eq!(start_plan(&w, 10), None);
        assert_eq!(start_plan(&[], 10), None);
        assert_eq!(start_plan(&w[..2], 0), None);
    }
}
