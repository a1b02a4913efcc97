//! The compute-limit oracle for co-adaptation (issue 43, item 7): how many tasks could meet their
//! SLO on one processor if each task's measured CPU work were scheduled earliest-deadline-first
//! with no overhead at all (no loads, no switches, no contention, preemption free).
//!
//! Each task arrives, needs `work` microseconds of the processor to reach its accuracy gain (what
//! it took measured alone; `None` when alone it never reached the gain, so no schedule meets its
//! SLO) and must finish by its deadline. The oracle runs preemptive EDF on one processor and drops a
//! task the moment its deadline passes unfinished (it can no longer meet the SLO, so its remaining
//! work would only delay others). Pure: the caller passes the measurements.

/// One task as the oracle sees it (microseconds on the caller's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleTask {
    /// When it arrives.
    pub arrival: u64,
    /// Processor time it needs to reach its gain (`None`: it never does).
    pub work: Option<u64>,
    /// When it must be done.
    pub deadline: u64,
}

/// Which tasks meet their deadline under preemptive EDF with no overhead (see the module docs), in
/// the order given. Ties on deadline go to the earlier arrival, then the lower index.
pub fn edf_meets(tasks: &[OracleTask]) -> Vec<bool> {
    let n = tasks.len();
    let mut met = vec![false; n];
    let mut left: Vec<u64> = tasks.iter().map(|t| t.work.unwrap_or(0)).collect();
    let mut arrived = vec![false; n];
    let mut gone: Vec<bool> = tasks.iter().map(|t| t.work.is_none() || t.deadline < t.arrival).collect();
    let mut now = tasks.iter().map(|t| t.arrival).min().unwrap_or(0);
    loop {
        for (i, t) in tasks.iter().enumerate() {
            if !arrived[i] && t.arrival <= now {
                arrived[i] = true;
            }
        }
        // Drop whatever can no longer finish by its deadline.
        for (i, t) in tasks.iter().enumerate() {
            if arrived[i] && !gone[i] && now.saturating_add(left[i]) > t.deadline {
                gone[i] = true;
            }
        }
        let ready = (0..n)
            .filter(|&i| arrived[i] && !gone[i])
            .min_by_key(|&i| (tasks[i].deadline, tasks[i].arrival, i));
        let next_arrival =
            tasks.iter().enumerate().filter(|(i, _)| !arrived[*i]).map(|(_, t)| t.arrival).min();
        match (ready, next_arrival) {
            (None, None) => break,
            (None, Some(a)) => now = a,
            (Some(i), next) => {
                let finish = now.saturating_add(left[i]);
                match next {
                    Some(a) if a < finish => {
                        left[i] -= a - now;
                        now = a;
                    }
                    _ => {
                        left[i] = 0;
                        now = finish;
                        met[i] = true;
                        gone[i] = true;
                    }
                }
            }
        }
    }
    met
}

/// The share of `tasks` meeting their deadline under [`edf_meets`] (1 for no tasks).
pub fn edf_attainment(tasks: &[OracleTask]) -> f64 {
    if tasks.is_empty() {
        return 1.0;
    }
    edf_meets(tasks).iter().filter(|m| **m).count() as f64 / tasks.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(arrival: u64, work: u64, deadline: u64) -> OracleTask {
        OracleTask { arrival, work: Some(work), deadline }
    }

    #[test]
    fn edf_by_hand() {
        // A (0, 4, dl 10) and B (1, 2, dl 4): B preempts A at 1, done at 3; A done at 6.
        assert_eq!(edf_meets(&[t(0, 4, 10), t(1, 2, 4)]), vec![true, true]);
        // FIFO would finish A at 4 and B at 6 > 4: EDF is what makes both fit.
        // Three tasks of 3 due at 5: only one fits; the others are dropped at the point they
        // cannot finish, so they do not delay a later task due at 12.
        let v = edf_meets(&[t(0, 3, 5), t(0, 3, 5), t(0, 3, 5), t(4, 3, 12)]);
        assert_eq!(v, vec![true, false, false, true]);
        assert!((edf_attainment(&[t(0, 3, 5), t(0, 3, 5), t(0, 3, 5), t(4, 3, 12)]) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn tasks_that_never_reach_the_gain_never_meet_and_cost_nothing() {
        let never = OracleTask { arrival: 0, work: None, deadline: 100 };
        assert_eq!(edf_meets(&[never, t(0, 100, 100)]), vec![false, true]);
        assert_eq!(edf_attainment(&[]), 1.0);
        // Idle gaps are skipped: a task arriving late starts at its arrival.
        assert_eq!(edf_meets(&[t(0, 1, 1), t(1000, 5, 1005)]), vec![true, true]);
        assert_eq!(edf_meets(&[t(0, 1, 1), t(1000, 6, 1005)]), vec![true, false]);
    }

    #[test]
    fn more_load_never_raises_attainment_on_the_same_arrivals() {
        // The same three arrivals with growing work: the count met never rises.
        let mut last = usize::MAX;
        for w in [1u64, 2, 4, 8, 16, 32] {
            let met = edf_meets(&[t(0, w, 20), t(3, w, 25), t(6, w, 30)]).iter().filter(|m| **m).count();
            assert!(met <= last, "work {w}: {met} > {last}");
            last = met;
        }
        assert_eq!(last, 0);
    }
}
