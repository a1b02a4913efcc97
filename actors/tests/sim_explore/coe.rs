//! The fault explorer on the coe workload: the real coe scheduler (journal on its node's own
//! disk), executors on SimCompute and the request service on the simulated cluster, under
//! seeded crashes and restarts of every node but the client's (the scheduler's too, with a torn
//! journal tail), partitions, loss/delay bursts and scheduler panics through the fault switch;
//! every invariant checked, and one seed replayed to the same event log.

use std::sync::Mutex;

use troupe_actors::sim::explore::coe::CoeWorkload;
use troupe_actors::sim::explore::{ExploreConfig, replay_command, run_seed, sweep_with};
use troupe_policy::sim::{FaultSchedule, SimFault};

/// The coe scheduler and executors register under fixed names in ractor's process-wide
/// registry, so the runs of this file go one at a time.
static ONE_RUN: Mutex<()> = Mutex::new(());

fn one() -> std::sync::MutexGuard<'static, ()> {
    ONE_RUN.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Seeds CI runs (consecutive from 0); `TROUPE_SIM_SEEDS` asks for more (a longer sweep).
fn seeds() -> u64 {
    super::seeds(350)
}

/// Seeds that still fail (see docs/testing.md): the sweep must fail on exactly these, so a new
/// violation fails CI and a fix must take its seed off this list (and make it a regression
/// test). None today.
const KNOWN_OPEN: &[u64] = &[];

fn workload() -> CoeWorkload {
    CoeWorkload::standard().unwrap()
}

#[test]
fn sim_explore_coe_seeds_hold_every_invariant() {
    let _one = one();
    let w = workload();
    let n = seeds();
    let config = ExploreConfig::default();
    let s = sweep_with(
        &w,
        0,
        n,
        |tag, seed| w.schedule(tag, seed, &config),
        |v| {
            if !v.violations.is_empty() {
                println!("seed {}: {:?}", v.seed, v.violations);
            }
        },
    );
    super::check_sweep(&s, KNOWN_OPEN, n);
}

/// A seed that crashes the scheduler node and panics its scheduler replays to the same event
/// log, byte for byte; another seed gives another log.
#[test]
fn sim_explore_coe_one_seed_replays_to_the_same_log() {
    let _one = one();
    let w = workload();
    let config = ExploreConfig::default();
    let seed = (0..200)
        .find(|&s| {
            let f = w.schedule("det", s, &config).faults;
            f.iter().any(|t| matches!(&t.fault, SimFault::Crash(n) if n == "det-sched"))
                && f.iter().any(|t| matches!(t.fault, SimFault::Panic(_)))
        })
        .expect("a seed crashing the scheduler node");
    let schedule = w.schedule("det", seed, &config);
    let a = run_seed(&w, "det", seed, &schedule, None);
    let b = run_seed(&w, "det", seed, &schedule, None);
    assert!(a.violations.is_empty(), "{:?}", a.violations);
    assert!(a.events > 100, "a run worth comparing: {} events", a.events);
    assert_eq!(a.log_hash, b.log_hash, "same seed, same event log");
    assert_eq!(a.answers, b.answers);
    assert!(a.log.iter().any(|l| l.contains("test crashes det-sched")), "the scheduler node crashed");
    let other = run_seed(&w, "det", seed + 1, &w.schedule("det", seed + 1, &config), None);
    assert_ne!(a.log_hash, other.log_hash, "another seed, another run");
}

/// Runs `seed` of the standard workload (tag `tag`) after checking that its schedule still has
/// the shape the bug needed (`shape`), and asserts the run held every invariant.
fn regression(tag: &str, seed: u64, shape: impl Fn(&FaultSchedule) -> bool) {
    let _one = one();
    let w = workload();
    let schedule = w.schedule(tag, seed, &ExploreConfig::default());
    assert!(shape(&schedule), "seed {seed} no longer draws the faults it was found with: {schedule:?}");
    let v = run_seed(&w, tag, seed, &schedule, None);
    assert!(
        v.violations.is_empty(),
        "seed {seed}: {:?}; replay: {}",
        v.violations,
        replay_command("coe", seed)
    );
    assert_eq!(v.answers.answers.len() as u64, w.requests);
}

fn has(s: &FaultSchedule, f: impl Fn(&SimFault) -> bool) -> bool {
    s.faults.iter().any(|t| f(&t.fault))
}

/// Found by the explorer (coe seed 1): the scheduler node, cut off from both executors, lost
/// them one after the other; the policy refused to lose the last ("would leave e0 with no live
/// executor") and the scheduler failed, then never ran anything again. Fixed: the policy parks
/// what no live executor can hold until one is restored (`RequestScheduler::handle_executor_lost`).
#[test]
fn sim_explore_coe_seed_1_losing_every_executor_parks_the_work() {
    regression("r1", 1, |s| has(s, |f| matches!(f, SimFault::Partition(n) if n == "r1-sched")));
}

/// Found by the explorer (coe seed 6): an executor's node rejoined, but its hello went
/// unanswered within the call timeout (a loss burst), and the scheduler node never looked for it
/// again. Fixed: `follow_executors` searches until found or the node is down again.
#[test]
fn sim_explore_coe_seed_6_a_rejoined_executor_is_searched_for_until_found() {
    regression("r6", 6, |s| {
        has(s, |f| matches!(f, SimFault::Restart(n) if n == "r6-exec1"))
            && has(s, |f| matches!(f, SimFault::Impair { .. }))
    });
}

/// Found by the explorer (coe seed 23): an executor node's partition healed while the scheduler
/// node was crashed; the heal reconnected only running nodes, so the restarted scheduler node
/// stayed cut off from it for good (an explorer bug). Fixed: a partition and its heal cover
/// every node of the cluster, running or not.
#[test]
fn sim_explore_coe_seed_23_a_heal_reconnects_a_node_crashed_at_the_time() {
    regression("r23", 23, |s| {
        has(s, |f| matches!(f, SimFault::Heal(n) if n == "r23-exec0"))
            && has(s, |f| matches!(f, SimFault::Crash(n) if n == "r23-sched"))
    });
}

/// Found by the explorer (coe seeds 27, 41): a call to an executor lost in a loss burst (its
/// node up all along) took the executor out of service for good: only a membership rejoin put
/// one back. Fixed: a link that loses a call is reported (`CoeShared::subscribe_link_lost`) and
/// `follow_executors` finds and links the executor again. Seed 41 has no crash nor partition.
#[test]
fn sim_explore_coe_seeds_27_and_41_an_executor_whose_call_was_lost_serves_again() {
    regression("r41", 41, |s| !has(s, |f| matches!(f, SimFault::Crash(_) | SimFault::Partition(_))));
    regression("r27", 27, |s| has(s, |f| matches!(f, SimFault::Crash(n) if n == "r27-sched")));
}

/// Found by the explorer (coe seed 32): the restarted scheduler node's hello to an executor was
/// lost and `find_executors` failed the scheduler's start. Fixed: a hello with no reply is sent
/// again (the name resolved afresh) while the deadline allows.
#[test]
fn sim_explore_coe_seed_32_a_lost_hello_does_not_fail_the_scheduler_start() {
    regression("r32", 32, |s| has(s, |f| matches!(f, SimFault::Restart(n) if n == "r32-sched")));
}

/// Found by the explorer's 1,000-seed sweep (coe seeds 285, 499, 886, 930): the restarted
/// scheduler node got an executor node's announcement just before hearing that node up again
/// (a partition healing); the lookup skipped it as down, and nothing woke the lookup once it was
/// up, so the scheduler never started. Fixed: a member coming up wakes waiting lookups
/// (`Actors::follow_membership`).
#[test]
fn sim_explore_coe_seed_886_a_lookup_wakes_when_its_provider_comes_up() {
    regression("r886", 886, |s| {
        has(s, |f| matches!(f, SimFault::Restart(n) if n == "r886-sched"))
            && has(s, |f| matches!(f, SimFault::Partition(n) if n == "r886-sched"))
    });
}

/// Found by the explorer's 1,000-seed sweep (coe seed 309): a scheduler panicked right after its
/// start had queued a reset on each executor's link; the next incarnation queued its own, took
/// the dead one's reset for its own, and failed on the load that followed ("executor x1 is not
/// loading e4"), again and again until the supervisor gave up. Fixed: a new incarnation renews
/// every link's generation (`CoeShared::renew_link`), so nothing an earlier one asked for is
/// taken as its own.
#[test]
fn sim_explore_coe_seed_309_a_dead_incarnations_reset_is_not_taken_for_the_new_ones() {
    regression("r309", 309, |s| has(s, |f| matches!(f, SimFault::Panic(n) if n == "r309-sched")));
}

/// Found by the explorer's 1,000-seed sweep (coe seeds 527, 812): the scheduler node restarted
/// while an executor's node was down; the search for the executors ran out of time and the
/// scheduler never started, leaving the requests it had accepted unanswered. Fixed: a job
/// resuming accepted work searches on past its deadline (`find_executors_for_job`), on a real
/// node as here.
#[test]
fn sim_explore_coe_seeds_527_and_812_a_restart_resuming_work_waits_for_its_executors() {
    regression("r527", 527, |s| has(s, |f| matches!(f, SimFault::Restart(n) if n == "r527-sched")));
    regression("r812", 812, |s| has(s, |f| matches!(f, SimFault::Restart(n) if n == "r812-sched")));
}

/// Found by a sweep of seeds 3000..4000 with clock skew (coe seeds 3881, 3991): the scheduler
/// node restarted with nothing pending (3881), or started for the first time (3991), while an
/// executor's node was cut off past its search's deadline; a job with nothing accepted gave up,
/// so that node never served again. Fixed: a serving job keeps searching
/// (`find_executors_for_job`), on a real node too.
#[test]
fn sim_explore_coe_seeds_3881_and_3991_a_serving_scheduler_searches_until_its_executors_answer() {
    regression("r3881", 3881, |s| has(s, |f| matches!(f, SimFault::Restart(n) if n == "r3881-sched")));
    regression("r3991", 3991, |s| has(s, |f| matches!(f, SimFault::Partition(_))));
}
