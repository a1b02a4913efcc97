//! The fault explorer (simulation only) in CI: each workload's seeds under seeded crashes,
//! restarts, partitions, loss/delay bursts (and, for coe, torn journal tails and scheduler
//! panics), every invariant checked; a replay of one seed per workload to the same event log;
//! and one regression test per bug the explorer found. One test binary, so the workloads'
//! sweeps run side by side on the harness's threads. CI runs 1,000 seeds across the coe,
//! pipeline and coadapt workloads (350 + 300 + 350) and 100 of the typed one;
//! `TROUPE_SIM_SEEDS=N` runs N of each (see docs/testing.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod coadapt;
mod coe;
mod pipeline;
mod typed;

use troupe_actors::sim::explore::{
    ExploreConfig, SimWorkload, Sweep, Verdict, replay_command, run_seed, schedule_with_process_faults,
};
use troupe_policy::sim::SimFault;
use troupe_policy::sim::faults::Tear;

/// Seeds a workload's CI sweep runs (consecutive from 0): `ci`, or `TROUPE_SIM_SEEDS` when set
/// (a longer sweep).
fn seeds(ci: u64) -> u64 {
    std::env::var("TROUPE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(ci)
}

/// Fails unless sweep `s` ran `n` seeds and failed on exactly the seeds of `known_open` below
/// `n` (a known-open seed that passes must leave the list and become a regression test); prints
/// its `sim_` figures.
fn check_sweep(s: &Sweep, known_open: &[u64], n: u64) {
    let open: Vec<u64> = s.failed.iter().map(|v| v.seed).filter(|seed| known_open.contains(seed)).collect();
    let known: Vec<u64> = known_open.iter().copied().filter(|seed| *seed < n).collect();
    assert_eq!(open, known, "a known-open seed now passes: take it off its list, make it a regression test");
    let failed: Vec<String> = s
        .failed
        .iter()
        .filter(|v| !known_open.contains(&v.seed))
        .map(|v| {
            format!("seed {}: {:?}; replay: {}", v.seed, v.violations, replay_command(v.workload, v.seed))
        })
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert_eq!(s.seeds, n);
    let w = s.workload;
    println!(
        "sim_{w}_seeds {} sim_{w}_seeds_per_min {:.0} sim_{w}_events_per_s {:.0} wall {:?}",
        s.seeds,
        s.seeds_per_min(),
        s.events_per_s(),
        s.wall
    );
}

/// Runs the first seed from `from` whose sweep schedule (under `tag`) crashes a node of the
/// workload's `disks`, tears its journal mid-append (a cut header or body, or a bad checksum),
/// and restarts it: the restarted node must cut the tail and the run hold every invariant.
/// Returns the verdict (its log names the tear).
fn torn_journal_run<W: SimWorkload>(w: &W, tag: &str, from: u64) -> Verdict {
    let config = ExploreConfig::default();
    let (nodes, disks) = (w.nodes(tag), w.disks(tag));
    assert!(!disks.is_empty(), "{} keeps no journal", w.name());
    let (seed, schedule) = (from..from + 500)
        .map(|seed| (seed, schedule_with_process_faults(seed, &nodes, &disks, &[], &config)))
        .find(|(_, s)| {
            let torn = s.faults.iter().position(|f| {
                matches!(&f.fault, SimFault::Tear(_, Tear::Header(_) | Tear::Body(_) | Tear::BadChecksum))
            });
            torn.is_some_and(|i| {
                s.faults[i..].iter().any(|f| matches!(&f.fault, SimFault::Restart(n) if disks.contains(n)))
            })
        })
        .expect("a seed tearing a journal, then restarting its node");
    let v = run_seed(w, tag, seed, &schedule, None);
    assert!(
        v.violations.is_empty(),
        "seed {seed}: {:?}; replay: {}",
        v.violations,
        replay_command(w.name(), seed)
    );
    assert!(
        v.log.iter().any(|l| l.contains("Tear(") && !l.contains("(0 files left torn)")),
        "seed {seed}: no journal was torn: {:?}",
        v.log.iter().filter(|l| l.contains("Tear(")).collect::<Vec<_>>()
    );
    v
}
