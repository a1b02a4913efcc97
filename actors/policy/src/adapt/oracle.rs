//! The compute-limit oracle for co-adaptation (issue 43, item 7): how many tasks could meet their
//! SLO on one processor if each task's measured CPU work were scheduled earliest-deadline-first
//! with no overhead at all (no loads, no switches, no contention, preemption free).
//!
//! Each task arrives, needs `work` microseconds of the processor (as measured: to its accuracy
//! gain, or until it was given back without it; the bench measures it alone beforehand, and in
//! the very run it judges) and must finish by its deadline. Two oracles, by how much they know
//! ([`Foresight`]):
//! - [`Foresight::Edf`], the issue's: preemptive EDF on the measured work. A task whose deadline
//!   passes unfinished is dropped then (it can no longer meet its SLO); a task that never reaches
//!   its gain runs like any other, since nothing tells the scheduler so in advance.
//! - [`Foresight::Clairvoyant`], a stronger yardstick: it also knows each task's work and
//!   outcome in advance, so it never runs a task that will not reach its gain and drops a task
//!   the moment its remaining work no longer fits before its deadline.
//!
//! Pure: the caller passes the measurements.

/// One task as the oracle sees it (microseconds on the caller's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleTask {
    /// When it arrives.
    pub arrival: u64,
    /// Processor time it took: to its gain, or until it was given back without it.
    pub work: u64,
    /// Whether it reached its gain (if not, no schedule meets its SLO).
    pub reaches_gain: bool,
    /// When it must be done.
    pub deadline: u64,
}

/// What the oracle knows in advance (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Foresight {
    /// Preemptive EDF on the measured work, a task dropped when its deadline passes.
    Edf,
    /// EDF that also knows every task's work and outcome in advance.
    Clairvoyant,
}

/// Which tasks meet their deadline under preemptive EDF with no overhead and `foresight` (see the
/// module docs), in the order given. Ties on deadline go to the earlier arrival, then the lower
/// index.
pub fn edf_meets(tasks: &[OracleTask], foresight: Foresight) -> Vec<bool> {
    let clairvoyant = foresight == Foresight::Clairvoyant;
    let n = tasks.len();
    let mut met = vec![false; n];
    let mut left: Vec<u64> = tasks.iter().map(|t| t.work).collect();
    let mut arrived = vec![false; n];
    let mut gone: Vec<bool> =
        tasks.iter().map(|t| (clairvoyant && !t.reaches_gain) || t.deadline < t.arrival).collect();
    let mut now = tasks.iter().map(|t| t.arrival).min().unwrap_or(0);
    loop {
        for (i, t) in tasks.iter().enumerate() {
            if !arrived[i] && t.arrival <= now {
                arrived[i] = true;
            }
        }
        // Drop whatever can no longer meet its deadline: with foresight, as soon as its remaining
        // work no longer fits; without, once the deadline has come with work left.
        for (i, t) in tasks.iter().enumerate() {
            let late = if clairvoyant { now.saturating_add(left[i]) > t.deadline } else { now >= t.deadline };
            if arrived[i] && !gone[i] && left[i] > 0 && late {
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
                // the next event: an arrival, or (without foresight) the running task's deadline
                let stop =
                    next.into_iter().chain((finish > tasks[i].deadline).then_some(tasks[i].deadline)).min();
                match stop {
                    Some(s) if s < finish => {
                        left[i] -= s - now;
                        now = s;
                    }
                    _ => {
                        left[i] = 0;
                        now = finish;
                        met[i] = tasks[i].reaches_gain;
                        gone[i] = true;
                    }
                }
            }
        }
    }
    met
}

/// The share of `tasks` meeting their deadline under [`edf_meets`] (1 for no tasks).
pub fn edf_attainment(tasks: &[OracleTask], foresight: Foresight) -> f64 {
    if tasks.is_empty() {
        return 1.0;
    }
    edf_meets(tasks, foresight).iter().filter(|m| **m).count() as f64 / tasks.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(arrival: u64, work: u64, deadline: u64) -> OracleTask {
        OracleTask { arrival, work, reaches_gain: true, deadline }
    }

    const BOTH: [Foresight; 2] = [Foresight::Edf, Foresight::Clairvoyant];

    #[test]
    fn edf_by_hand() {
        for f in BOTH {
            // A (0, 4, dl 10) and B (1, 2, dl 4): B preempts A at 1, done at 3; A done at 6.
            assert_eq!(edf_meets(&[t(0, 4, 10), t(1, 2, 4)], f), vec![true, true]);
            // FIFO would finish A at 4 and B at 6 > 4: EDF is what makes both fit.
        }
        // Three tasks of 3 due at 5, then one of 3 due at 12 arriving at 4. With foresight the two
        // that cannot fit are dropped at once: the last one runs 4..7.
        let v = [t(0, 3, 5), t(0, 3, 5), t(0, 3, 5), t(4, 3, 12)];
        assert_eq!(edf_meets(&v, Foresight::Clairvoyant), vec![true, false, false, true]);
        assert!((edf_attainment(&v, Foresight::Clairvoyant) - 0.5).abs() < 1e-12);
        // Without it the second runs 3..5 and is dropped at its deadline; the third is dropped
        // then too, and the last runs 5..8, still in time.
        assert_eq!(edf_meets(&v, Foresight::Edf), vec![true, false, false, true]);
    }

    #[test]
    fn without_foresight_a_doomed_task_delays_the_next() {
        // A (0, 10, dl 6) cannot finish; B (1, 4, dl 9) could, alone. EDF runs A (earlier
        // deadline) until 6, then B has 3 left before 9 and needs 4: both miss. Foresight drops A
        // at 0 and B finishes at 5.
        let v = [t(0, 10, 6), t(1, 4, 9)];
        assert_eq!(edf_meets(&v, Foresight::Edf), vec![false, false]);
        assert_eq!(edf_meets(&v, Foresight::Clairvoyant), vec![false, true]);
    }

    #[test]
    fn a_task_that_never_reaches_its_gain_costs_only_without_foresight() {
        let never = OracleTask { arrival: 0, work: 50, reaches_gain: false, deadline: 60 };
        // EDF runs it (it finishes at 50 without its gain): the other, due at 100, has 50 left.
        assert_eq!(edf_meets(&[never, t(0, 50, 100)], Foresight::Edf), vec![false, true]);
        assert_eq!(edf_meets(&[never, t(0, 51, 100)], Foresight::Edf), vec![false, false]);
        // The clairvoyant oracle never runs it.
        assert_eq!(edf_meets(&[never, t(0, 100, 100)], Foresight::Clairvoyant), vec![false, true]);
        for f in BOTH {
            assert_eq!(edf_attainment(&[], f), 1.0);
            // Idle gaps are skipped: a task arriving late starts at its arrival.
            assert_eq!(edf_meets(&[t(0, 1, 1), t(1000, 5, 1005)], f), vec![true, true]);
            assert_eq!(edf_meets(&[t(0, 1, 1), t(1000, 6, 1005)], f), vec![true, false]);
        }
    }

    #[test]
    fn more_load_never_raises_attainment_on_the_same_arrivals() {
        for f in BOTH {
            // The same three arrivals with growing work: the count met never rises.
            let mut last = usize::MAX;
            for w in [1u64, 2, 4, 8, 16, 32] {
                let met =
                    edf_meets(&[t(0, w, 20), t(3, w, 25), t(6, w, 30)], f).iter().filter(|m| **m).count();
                assert!(met <= last, "{f:?}, work {w}: {met} > {last}");
                last = met;
            }
            assert_eq!(last, 0);
        }
    }

    #[test]
    fn foresight_never_does_worse_on_these_loads() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        // Seeded random task sets: the clairvoyant oracle meets at least as many as plain EDF.
        let mut rng = SmallRng::seed_from_u64(43);
        for _ in 0..200 {
            let v: Vec<OracleTask> = (0..8)
                .map(|_| {
                    let a = rng.random_range(0..100);
                    OracleTask {
                        arrival: a,
                        work: rng.random_range(1..41),
                        reaches_gain: rng.random_range(0..5) > 0,
                        deadline: a + rng.random_range(10..70),
                    }
                })
                .collect();
            let count = |f| edf_meets(&v, f).iter().filter(|m| **m).count();
            assert!(count(Foresight::Clairvoyant) >= count(Foresight::Edf), "{v:?}");
        }
    }
}
