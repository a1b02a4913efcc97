//! The chaos schedule: which faults a chaos run injects, and when, decided from a seed alone.
//!
//! A chaos run (`troupe chaos`) kills nodes with SIGKILL and starts them again, and panics actors
//! through the fault switch ([`crate::fault`]), while a topology's jobs run. This module decides
//! the faults; the caller performs them. The decision is pure: the caller passes the seed, the
//! nodes that may be killed, the fault sites and their hit ranges, and the restart delays, and
//! [`schedule`] returns the same faults for the same inputs, so a failing run can be replayed.
//!
//! Kills are keyed to *milestones*: progress lines the jobs print (such as `coe: completed 50 of`),
//! not to wall-clock times, so a kill lands while the work it disturbs is still under way however
//! fast or slow the machine is. A node is killed at most once per run (the campus's jobs are
//! short: a second kill of a node just back would rarely land while they still run), and
//! started again after a drawn delay.
//!
//! Nodes that run a job (the schedulers and foremen whose end is the run's end) are killed like
//! any other: their jobs are journaled, and a restarted job node resumes its job from the journal.
//! Nodes whose actors or job do not recover from a restart (`restart_safe == false`) are never
//! killed.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::time::Micros;

/// A node a chaos run might kill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChaosNode {
    /// Node name.
    pub name: String,
    /// Whether every actor on it, and its job if it runs one, recovers from a kill and a restart (others are never killed).
    pub restart_safe: bool,
    /// The milestones (progress-line prefixes) at which killing it disturbs work under way,
    /// in the order the jobs reach them.
    pub milestones: Vec<String>,
}

/// A fault-switch site a chaos run might fire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChaosSite {
    /// Site name, e.g. `coe.scheduler`.
    pub site: String,
    /// The node whose actor hits it.
    pub node: String,
    /// Smallest hit number to fire at (1-based).
    pub first_hit: u64,
    /// Largest hit number to fire at: a fault-free run reaches the site at least this often.
    pub last_hit: u64,
}

/// What [`schedule`] is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChaosSpec {
    /// The seed: the same seed gives the same faults.
    pub seed: u64,
    /// How many faults to inject.
    pub faults: usize,
    /// The topology's nodes.
    pub nodes: Vec<ChaosNode>,
    /// The fault sites.
    pub sites: Vec<ChaosSite>,
    /// Shortest delay from a kill to the restart.
    pub restart_min: Micros,
    /// Longest delay from a kill to the restart.
    pub restart_max: Micros,
}

/// One fault of a schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL `node` when a job prints `milestone`, and start it again once a job has declared
    /// it lost, or `restart_after` after the kill at the latest.
    Kill {
        /// The node killed.
        node: String,
        /// The progress-line prefix that triggers the kill.
        milestone: String,
        /// Delay from the kill to the restart.
        restart_after: Micros,
    },
    /// Panic the actor at `site` (on `node`) at its `after_hits`-th hit.
    Panic {
        /// The fault site.
        site: String,
        /// The node it is on.
        node: String,
        /// The hit (1-based) at which it fires.
        after_hits: u64,
    },
}

/// Why no schedule could be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// More faults were asked for than the topology has room for.
    #[error(
        "{asked} faults asked for, but this topology has room for {room} ({kills} killable nodes, one kill each; {panics} fault-switch sites)"
    )]
    TooManyFaults {
        /// Faults asked for.
        asked: usize,
        /// Faults possible.
        room: usize,
        /// Kill slots (one per killable node).
        kills: usize,
        /// Panic slots (one per site).
        panics: usize,
    },
    /// A range is empty.
    #[error("{what}: the range {lo}..={hi} is empty")]
    EmptyRange {
        /// Which range.
        what: String,
        /// Its low end.
        lo: u64,
        /// Its high end.
        hi: u64,
    },
}

/// Draws the faults of a chaos run from `spec.seed`: exactly `spec.faults` of them, kills and
/// panics alternating (kill first) while both kinds have room left, panics first in the result
/// (they are installed before the run starts), then kills in node and milestone order.
pub fn schedule(spec: &ChaosSpec) -> Result<Vec<Fault>, ScheduleError> {
    if spec.restart_min > spec.restart_max {
        return Err(ScheduleError::EmptyRange {
            what: "restart delay (µs)".into(),
            lo: spec.restart_min.0,
            hi: spec.restart_max.0,
        });
    }
    if let Some(s) = spec.sites.iter().find(|s| s.first_hit == 0 || s.first_hit > s.last_hit) {
        return Err(ScheduleError::EmptyRange {
            what: format!("site {} hits (counted from 1)", s.site),
            lo: s.first_hit,
            hi: s.last_hit,
        });
    }
    let mut kills: Vec<(usize, usize)> = spec
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.restart_safe && !n.milestones.is_empty())
        .map(|(i, _)| (i, 0))
        .collect();
    let mut panics: Vec<usize> = (0..spec.sites.len()).collect();
    let room = kills.len() + panics.len();
    if spec.faults > room {
        return Err(ScheduleError::TooManyFaults {
            asked: spec.faults,
            room,
            kills: kills.len(),
            panics: panics.len(),
        });
    }
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    for (i, m) in &mut kills {
        *m = rng.random_range(0..spec.nodes[*i].milestones.len());
    }
    kills.shuffle(&mut rng);
    panics.shuffle(&mut rng);
    let (mut chosen_kills, mut chosen_panics) = (Vec::new(), Vec::new());
    let (mut ki, mut pi) = (kills.into_iter(), panics.into_iter());
    while chosen_kills.len() + chosen_panics.len() < spec.faults {
        let kill_turn = chosen_kills.len() <= chosen_panics.len();
        match (kill_turn, ki.len() > 0, pi.len() > 0) {
            (true, true, _) | (false, true, false) => chosen_kills.extend(ki.next()),
            _ => chosen_panics.extend(pi.next()),
        }
    }
    chosen_panics.sort_unstable();
    chosen_kills.sort_unstable();
    let mut out = Vec::with_capacity(spec.faults);
    for p in chosen_panics {
        let s = &spec.sites[p];
        out.push(Fault::Panic {
            site: s.site.clone(),
            node: s.node.clone(),
            after_hits: rng.random_range(s.first_hit..=s.last_hit),
        });
    }
    for (n, m) in chosen_kills {
        let node = &spec.nodes[n];
        out.push(Fault::Kill {
            node: node.name.clone(),
            milestone: node.milestones[m].clone(),
            restart_after: Micros(rng.random_range(spec.restart_min.0..=spec.restart_max.0)),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, restart_safe: bool, milestones: &[&str]) -> ChaosNode {
        ChaosNode {
            name: name.into(),
            restart_safe,
            milestones: milestones.iter().map(|m| (*m).to_string()).collect(),
        }
    }

    fn spec(seed: u64, faults: usize) -> ChaosSpec {
        ChaosSpec {
            seed,
            faults,
            nodes: vec![
                node("gateway", true, &["coe: completed 25 of", "coe: completed 50 of"]),
                node("camera", false, &["pipeline: 10 of"]),
                node("worker-1", true, &["pipeline: 10 of", "pipeline: 20 of", "pipeline: 30 of"]),
                node("worker-2", true, &["pipeline: 10 of", "pipeline: 20 of", "pipeline: 30 of"]),
                node("executor", true, &["coe: completed 25 of", "coe: completed 50 of"]),
                node("idle", true, &[]),
            ],
            sites: vec![
                ChaosSite {
                    site: "coe.scheduler".into(),
                    node: "gateway".into(),
                    first_hit: 10,
                    last_hit: 60,
                },
                ChaosSite {
                    site: "pipeline.scheduler".into(),
                    node: "box".into(),
                    first_hit: 5,
                    last_hit: 30,
                },
            ],
            restart_min: Micros::from_millis(200),
            restart_max: Micros::from_millis(1500),
        }
    }

    #[test]
    fn same_seed_same_schedule() {
        for seed in 0..50 {
            assert_eq!(schedule(&spec(seed, 6)), schedule(&spec(seed, 6)));
        }
    }

    #[test]
    fn different_seeds_give_different_schedules() {
        let all: std::collections::BTreeSet<String> =
            (0..20).map(|s| format!("{:?}", schedule(&spec(s, 4)).unwrap())).collect();
        assert!(all.len() > 10, "only {} distinct schedules from 20 seeds", all.len());
    }

    #[test]
    fn exactly_n_faults_kills_and_panics_alternating() {
        // four killable nodes with milestones (the job node among them), two sites
        let want = [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (4, 2)];
        for (n, (kills, panics)) in want.iter().enumerate() {
            let s = schedule(&spec(9, n)).unwrap();
            assert_eq!(s.len(), n);
            let k = s.iter().filter(|f| matches!(f, Fault::Kill { .. })).count();
            assert_eq!((k, n - k), (*kills, *panics), "n = {n}: {s:?}");
        }
        let e = schedule(&spec(9, 7)).unwrap_err();
        assert_eq!(e, ScheduleError::TooManyFaults { asked: 7, room: 6, kills: 4, panics: 2 });
    }

    #[test]
    fn kills_job_nodes_too_but_never_nodes_that_do_not_recover() {
        let mut job_node_killed = false;
        for seed in 0..100 {
            for f in schedule(&spec(seed, 5)).unwrap() {
                if let Fault::Kill { node, .. } = f {
                    assert!(node != "camera" && node != "idle", "seed {seed} kills {node}");
                    job_node_killed |= node == "gateway";
                }
            }
        }
        assert!(job_node_killed, "no seed kills the job node");
    }

    #[test]
    fn a_node_is_killed_once_and_draws_stay_in_range() {
        let mut milestones = std::collections::BTreeSet::new();
        for seed in 0..100 {
            let s = schedule(&spec(seed, 5)).unwrap();
            let mut keys: Vec<String> = Vec::new();
            for f in &s {
                match f {
                    Fault::Kill { node, milestone, restart_after } => {
                        assert!((200..=1500).contains(&restart_after.as_millis()));
                        keys.push(node.clone());
                        milestones.insert(milestone.clone());
                    }
                    Fault::Panic { site, after_hits, .. } => {
                        let r = if site == "coe.scheduler" { 10..=60 } else { 5..=30 };
                        assert!(r.contains(after_hits), "{site} at {after_hits}");
                    }
                }
            }
            let n = keys.len();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), n, "seed {seed}: a node killed twice");
        }
        assert_eq!(milestones.len(), 5, "every milestone is drawn for some seed: {milestones:?}");
    }

    #[test]
    fn empty_ranges_are_named() {
        let mut s = spec(1, 1);
        s.restart_min = Micros::from_millis(2000);
        assert!(schedule(&s).unwrap_err().to_string().contains("restart delay"));
        let mut s = spec(1, 1);
        s.sites[0].first_hit = 0;
        assert!(schedule(&s).unwrap_err().to_string().contains("coe.scheduler"));
    }
}
