//! Measured: K adaptation tasks arriving as a seeded Poisson process, served for real by
//! [`EdgeEngine`] over [`troupe_kernels::vmoe::CoAdaptPool`] under each strategy, on one pool
//! budget and the same arrivals and samples for every strategy.
//!
//! **Strategies** (the paper's §5.1 baselines, as this engine can run them):
//! * `ours`: the twin-buffer scheduler, the frozen parts merged (shared once in the pool) and every
//!   [`Mechanisms`] switch on.
//! * `isolated`: edge-assisted isolated adaptation: arrival order, run to completion, every task
//!   holding its own copy of the frozen parts (`share_backbone: false`).
//! * `ams`: AMS (Khani et al. 2021), round-robin GPU sharing across tasks.
//! * `recl`: RECL (Khani et al. 2023), accuracy-first time slices.
//! * `moe_se`: MoE-SE, MoE-based co-adaptation executed sequentially: arrival order, run to
//!   completion, the frozen parts merged, none of AdaSprite's mechanisms.
//!
//! Merging decision: the paper files AMS and RECL under "edge-assisted *isolated* model
//! adaptation" (one model per task on a shared GPU, no parameter sharing across tasks) and MoE-SE
//! under "edge-assisted MoE-based co-adaptation"; so AMS, RECL and isolated run with
//! `share_backbone: false` (each task's footprint carries its own copy of the frozen parts) and
//! MoE-SE with `share_backbone: true`. The simulator (`troupe_policy::adapt::sim::Strategy`)
//! models them the same way (AMS/RECL `Execution::Isolated`). No baseline runs AdaSprite's
//! mechanisms (they are all switched off for it); none preloads.
//!
//! **Where ours puts the bytes merging saves**: the budget holds `budget_isolated_tasks` copies of
//! the frozen parts; merged, ours keeps one, and gives the others' bytes to the reuse cache's
//! memory tier ([`reuse_budget`]), so stem tokens stay in memory instead of going to disk.
//!
//! **SLO deadlines**: every job carries its SLO (`l_solo` solo times from its arrival); only the
//! twin-buffer scheduler reads it (`troupe_policy::adapt::slo`), as the baselines have no such
//! input in their papers.
//!
//! **Time** is the bench process's CPU time (`CLOCK_PROCESS_CPUTIME_ID`) plus the wall time its
//! steps spent blocked waiting for the reuse cache's disk reads
//! (`troupe_kernels::vmoe::reuse::io_stall_us`: a read a prefetch finished behind compute costs
//! nothing, a read the step waits for costs its wait; [`bench_clock_us`]): every step, load,
//! unload and validation, on the executor thread and on the threads the `threads` mechanism
//! (experts of a block on the kernels' expert pool) and `preload` (a background thread) use, so other load on
//! the machine does not stretch it and work moved to another thread is still counted. It is
//! conservative for ours: threads running at once are charged their sum, so parallelism earns
//! nothing here. While the engine is idle and the next task has not arrived, the clock jumps
//! forward to that arrival (idle device time costs no CPU). Arrivals are submitted between cycles,
//! stamped with their arrival time, so a cycle's wait counts in their latency.
//!
//! **Arrivals**: K tasks, a Poisson process of rate `K / (window x solo)`, i.e. K arrivals expected
//! within `window` solo times (the K tasks are concurrent), seeded per (seed, K).
//! **SLO**: exact-match gain against the teacher (on the task's held-out validation split) of at
//! least `gain` within `l_solo` solo times of its arrival, where the solo time is the median time
//! one task of the seed takes alone (isolated, run to completion) to reach `gain`.
//! **Epoch cap**: every strategy returns a task after as many epochs as the deadline gives one
//! task alone ([`epoch_cap`]: `l_solo` x the solo runs' median epochs); past it no task can meet
//! the SLO, and tasks that never reach the gain would otherwise hold the pool for the solo
//! runs' 60 epochs each.
//! **Throughput**: tasks meeting the SLO per minute of process CPU time, from the first arrival to
//! the last completion (the paper's "rate of tasks meeting their SLOs").
//! **Fragmentation**: time-weighted (`troupe_kernels::vmoe::pool::time_weighted_fragmentation`,
//! samples stamped with the process CPU time): each state of the pool's `fragmentation_samples`
//! (external fragmentation after every pool event) counts for as long as it lasted in the run, not
//! once per event.

use std::cell::Cell;
use std::collections::BTreeMap;

use anyhow::{Context, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_actors::coadapt::engine::{
    AdaptJob, EdgeEngine, EngineConfig, Mechanisms, ReuseStats, SchedulerChoice, reserved_bytes,
    reuse_default_bytes, shared_bytes, task_footprint,
};
use troupe_kernels::DeviceKind;
use troupe_kernels::vmoe::VMoe;
use troupe_kernels::vmoe::pool::time_weighted_fragmentation;
use troupe_kernels::vmoe::train::Dataset;
use troupe_policy::Micros;
use troupe_policy::adapt::oracle::{Foresight, OracleTask, edf_meets};

/// No AdaSprite mechanism (the baselines).
pub const NO_MECHANISMS: Mechanisms = Mechanisms::NONE;

/// One real configuration of the executor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RealStrategy {
    /// Name in keys and tables.
    pub name: &'static str,
    /// The scheduler.
    pub scheduler: SchedulerChoice,
    /// Frozen parts merged (true) or one copy per task.
    pub share_backbone: bool,
    /// AdaSprite's mechanisms.
    pub mechanisms: Mechanisms,
    /// The simulator strategy it corresponds to (`troupe_policy::adapt::sim::Strategy::name`).
    pub sim_name: &'static str,
}

impl RealStrategy {
    /// Ours: twin-buffer, merged, every mechanism.
    pub const OURS: Self = Self {
        name: "ours",
        scheduler: SchedulerChoice::Twin,
        share_backbone: true,
        mechanisms: Mechanisms::ALL,
        sim_name: "adasprite",
    };

    /// The baselines (see the module doc for the merging decision).
    pub const BASELINES: [Self; 4] = [
        Self {
            name: "isolated",
            scheduler: SchedulerChoice::Fifo,
            share_backbone: false,
            mechanisms: NO_MECHANISMS,
            sim_name: "isolated",
        },
        Self {
            name: "ams",
            scheduler: SchedulerChoice::RoundRobin,
            share_backbone: false,
            mechanisms: NO_MECHANISMS,
            sim_name: "ams-rr",
        },
        Self {
            name: "recl",
            scheduler: SchedulerChoice::AccuracyFirst,
            share_backbone: false,
            mechanisms: NO_MECHANISMS,
            sim_name: "recl-af",
        },
        Self {
            name: "moe_se",
            scheduler: SchedulerChoice::Fifo,
            share_backbone: true,
            mechanisms: NO_MECHANISMS,
            sim_name: "moe-se",
        },
    ];

    /// Ours with each mechanism off in turn (named by [`Mechanisms::NAMES`]), then ours without
    /// merging (`share_backbone`), then without both the reuse tier and the region
    /// (`reuse_region`).
    pub fn ablations() -> Vec<(&'static str, Self)> {
        let mut v: Vec<(&'static str, Self)> = Mechanisms::NAMES
            .iter()
            .filter_map(|n| {
                Mechanisms::ALL.without(n).map(|m| (*n, Self { mechanisms: m, sim_name: "", ..Self::OURS }))
            })
            .collect();
        v.push(("share_backbone", Self { share_backbone: false, sim_name: "", ..Self::OURS }));
        // Without the reuse tier, with and without the region: the region's effect where the
        // reuse arena is not there to sit on top.
        let no_reuse_region = Mechanisms { reuse: false, region: false, ..Mechanisms::ALL };
        v.push(("reuse_region", Self { mechanisms: no_reuse_region, sim_name: "", ..Self::OURS }));
        v
    }
}

/// The sweep's knobs (see the module doc for their meaning).
#[derive(Clone, Debug, PartialEq)]
pub struct SweepConfig {
    /// Concurrency levels, ascending.
    pub ks: Vec<usize>,
    /// Seeds: each is one set of camera streams and, per K, one arrival draw.
    pub seeds: Vec<u64>,
    /// SLO exact-match gain.
    pub gain: f64,
    /// SLO deadline in solo times.
    pub l_solo: f64,
    /// Arrival window in solo times (K arrivals expected within it).
    pub window_solo: f64,
    /// Pool budget: room for this many tasks' isolated state (own frozen parts, experts, projector
    /// and optimiser state) besides one step's buffers and the shared reserve.
    pub budget_isolated_tasks: u64,
    /// Uploaded samples per task.
    pub samples_per_task: usize,
    /// The engine's knobs other than scheduler, sharing, mechanisms and budget.
    pub engine: EngineConfig,
}

/// The pool budget of the sweep for `student` (the same for every strategy): the shared reserve
/// and one step's buffers, plus `tasks` tasks' state each with its own copy of the frozen parts.
/// It stands for a weak edge GPU where memory binds (the paper's RTX 3080/3090, where the
/// isolated baselines saturate at about 6 concurrent tasks).
pub fn pool_budget(student: &VMoe, batch: usize, tasks: u64) -> u64 {
    let c = student.config;
    reserved_bytes(&[c], batch) + tasks * (task_footprint(&c) + shared_bytes(&c))
}

/// The reuse cache's memory tier for strategy `s` (bytes, 0: the engine's default): with merging
/// and reuse on, the default plus the frozen-part copies the budget holds room for and merging
/// does not need (see the module doc).
pub fn reuse_budget(s: &RealStrategy, student: &VMoe, batch: usize, isolated_tasks: u64) -> u64 {
    if !(s.share_backbone && s.mechanisms.reuse) {
        return 0;
    }
    let c = student.config;
    reuse_default_bytes(&[c], batch) + isolated_tasks.saturating_sub(1) * shared_bytes(&c)
}

/// `k` arrival times (microseconds, ascending) of a Poisson process with mean gap `mean_gap_us`.
pub fn poisson_arrivals(k: usize, mean_gap_us: f64, seed: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0..k)
        .map(|_| {
            let u: f64 = rng.random::<f64>();
            t += -(1.0 - u).ln() * mean_gap_us.max(0.0);
            t as u64
        })
        .collect()
}

/// The largest K of the prefix of `ks` (ascending) whose attainment is at least `ratio`; 0 when
/// the first fails.
pub fn max_concurrency(ks: &[usize], attainment: &[f64], ratio: f64) -> usize {
    ks.iter().zip(attainment).take_while(|(_, a)| **a >= ratio - 1e-12).map(|(k, _)| *k).last().unwrap_or(0)
}

/// Share of pairs that two scores rank the same way (ties count as the same only when both tie).
pub fn pairwise_agreement(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (mut agree, mut pairs) = (0usize, 0usize);
    for i in 0..n {
        for j in i + 1..n {
            pairs += 1;
            if a[i].total_cmp(&a[j]) == b[i].total_cmp(&b[j]) {
                agree += 1;
            }
        }
    }
    if pairs == 0 { 1.0 } else { agree as f64 / pairs as f64 }
}

/// CPU time of this process (all its threads) in microseconds (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn process_cpu_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec we own; no other memory is touched.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1000
}

/// The bench's clock on the CPU, microseconds: this process's CPU time plus the wall time its
/// steps were blocked on storage reads (a stall burns no CPU but costs the device its time).
pub fn bench_clock_us() -> u64 {
    process_cpu_us() + troupe_kernels::vmoe::reuse::io_stall_us()
}

/// One run of one strategy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunOutcome {
    /// Per finished task: (latency s, exact-match gain).
    pub tasks: Vec<(f64, f64)>,
    /// Per finished task (same order): epochs trained.
    pub epochs: Vec<u32>,
    /// Per finished task (same order): its job's index, and its work in the run, microseconds:
    /// the processor time of its admission (the accuracy before, one validation: timed here
    /// around `submit`, or by the engine when a cycle admitted it) and of its own steps and
    /// validations (`Finished::work`).
    pub work: Vec<(usize, u64)>,
    /// Processor time the run took in all (idle gaps between arrivals left out), microseconds.
    pub busy_us: u64,
    /// First arrival to last completion, s.
    pub span_s: f64,
    /// External fragmentation over the run, time-weighted.
    pub fragmentation: f64,
    /// Peak pool bytes over the budget.
    pub peak_over_budget: f64,
    /// Bytes the pool's compaction moved (the lifespan-ordered layout closing departed models' holes).
    pub compacted_bytes: u64,
    /// Models unloaded to make room.
    pub evictions: u64,
    /// Reuse cache: microseconds of disk prefetch, and of those the ones overlapped by compute.
    pub prefetch_us: (u64, u64),
    /// The reuse cache's figures at the end (hits, reads, stall).
    pub reuse: ReuseStats,
    /// Training steps run.
    pub steps: u64,
}

impl RunOutcome {
    /// Tasks with gain >= `gain` within `l_s`.
    pub fn met(&self, gain: f64, l_s: f64) -> usize {
        self.tasks.iter().filter(|(t, g)| *g >= gain - 1e-12 && *t <= l_s).count()
    }

    /// Tasks the oracle (preemptive EDF, no overhead: `troupe_policy::adapt::oracle`) gets done
    /// within `l_us` of arrival on this run's own measured work per task, the tasks arriving at
    /// `arrivals_us` (by job index) and reaching `gain` as they did here.
    pub fn oracle_met(&self, arrivals_us: &[u64], gain: f64, l_us: u64) -> usize {
        let tasks: Vec<OracleTask> = self
            .work
            .iter()
            .zip(&self.tasks)
            .filter_map(|(&(job, work), &(_, g))| {
                let arrival = *arrivals_us.get(job)?;
                Some(OracleTask {
                    arrival,
                    work,
                    reaches_gain: g >= gain - 1e-12,
                    deadline: arrival.saturating_add(l_us),
                })
            })
            .collect();
        edf_meets(&tasks, Foresight::Edf).iter().filter(|m| **m).count()
    }
}

/// Serves `jobs` arriving at `arrivals_us` (same length) with `cfg` on a fresh engine; each job
/// carries the SLO `slo_within` of its arrival (which only the twin-buffer scheduler reads).
pub fn run_once(
    cfg: EngineConfig,
    student: &VMoe,
    jobs: &[Dataset],
    arrivals_us: &[u64],
    slo_within: Option<Micros>,
) -> Result<RunOutcome> {
    anyhow::ensure!(jobs.len() == arrivals_us.len(), "one arrival per job");
    let cfg = EngineConfig { max_tasks: cfg.max_tasks.max(jobs.len()), ..cfg };
    let mut eng = EdgeEngine::new(cfg, &[student.config])?;
    // On the CPU the device's time is this process's CPU time; a GPU's work is not CPU time, so
    // there the clock is wall time (each op waits for its results).
    let now: fn() -> u64 = match cfg.device {
        DeviceKind::Cpu => bench_clock_us,
        DeviceKind::Cuda(_) => troupe_kernels::vmoe::pool::monotonic_us,
    };
    eng.set_pool_clock(now);
    let skipped = Cell::new(0u64);
    let start = now();
    let clock = || Micros(now().saturating_sub(start) + skipped.get());
    let mut next = 0;
    let mut done = Vec::new();
    let mut job_of = BTreeMap::new();
    let mut admission = vec![0u64; jobs.len()];
    loop {
        while next < jobs.len() && arrivals_us[next] <= clock().0 {
            let job = AdaptJob {
                name: format!("task{next}"),
                model: student.clone(),
                samples: jobs[next].clone(),
                target_gain: None,
                slo_within,
            };
            let admitted = now();
            let id = eng
                .submit(Micros(arrivals_us[next]), job)
                .with_context(|| format!("submitting task {next}"))?;
            admission[next] = now().saturating_sub(admitted);
            job_of.insert(id, next);
            next += 1;
        }
        let (steps, before) = (eng.steps(), done.len());
        if eng.busy() {
            eng.run_cycle(&clock)?;
            done.extend(eng.take_finished());
        }
        let progressed = eng.steps() != steps || done.len() != before;
        if !progressed {
            if next < jobs.len() {
                // Idle until the next arrival: the device spends no time, the clock jumps.
                let now = clock().0;
                skipped.set(skipped.get() + arrivals_us[next].saturating_sub(now));
            } else if eng.busy() {
                anyhow::bail!("the real experiment stopped making progress");
            } else {
                break;
            }
        }
    }
    let first = arrivals_us.first().copied().unwrap_or(0);
    let last = done.iter().map(|f| f.done.0).max().unwrap_or(first);
    let frag = eng.pool().fragmentation_samples();
    Ok(RunOutcome {
        tasks: done
            .iter()
            .map(|f| (f.done.saturating_sub(f.arrived).as_secs_f64(), f.after - f.before))
            .collect(),
        epochs: done.iter().map(|f| f.epochs).collect(),
        work: done
            .iter()
            .map(|f| {
                let job = job_of.get(&f.task).copied().unwrap_or(usize::MAX);
                (job, f.work.0 + admission.get(job).copied().unwrap_or(0))
            })
            .collect(),
        busy_us: now().saturating_sub(start),
        span_s: (last.saturating_sub(first) as f64 / 1e6).max(1e-9),
        fragmentation: time_weighted_fragmentation(frag, now()).unwrap_or(0.0),
        peak_over_budget: eng.pool().peak_used() as f64 / cfg.budget.max(1) as f64,
        compacted_bytes: eng.pool().compacted_bytes(),
        evictions: eng.evictions(),
        prefetch_us: {
            let r = eng.reuse_stats();
            (r.prefetch_us, r.prefetch_hidden_us)
        },
        reuse: eng.reuse_stats(),
        steps: eng.steps(),
    })
}

/// One strategy at one K, summed over seeds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tally {
    /// Tasks meeting the SLO.
    pub met: usize,
    /// Tasks.
    pub tasks: usize,
    /// Summed spans, s.
    pub span_s: f64,
    /// Summed latencies of finished tasks, s.
    pub latency_sum_s: f64,
    /// Summed per-run mean fragmentation.
    pub frag_sum: f64,
    /// Runs.
    pub runs: usize,
    /// Worst peak over budget.
    pub peak: f64,
    /// Evictions.
    pub evictions: u64,
    /// Bytes moved by the pool's compaction.
    pub compacted_bytes: u64,
    /// Summed reuse-cache prefetch time and its part hidden behind compute, us.
    pub prefetch_us: (u64, u64),
    /// Tasks the oracle gets done on time on the runs' own measured work
    /// ([`RunOutcome::oracle_met`]).
    pub oracle_met: usize,
    /// The runs' tasks' work and the runs' processor time in all, microseconds
    /// ([`RunOutcome::work`], [`RunOutcome::busy_us`]).
    pub work_busy_us: (u64, u64),
}

impl Tally {
    /// SLO attainment.
    pub fn attainment(&self) -> f64 {
        self.met as f64 / self.tasks.max(1) as f64
    }
    /// SLO-meeting tasks per minute.
    pub fn throughput_per_min(&self) -> f64 {
        self.met as f64 / (self.span_s / 60.0).max(1e-12)
    }
    /// Mean fragmentation.
    pub fn fragmentation(&self) -> f64 {
        self.frag_sum / self.runs.max(1) as f64
    }
    /// Megabytes the pool's compaction copied per task.
    pub fn compacted_mb_per_task(&self) -> f64 {
        self.compacted_bytes as f64 / 1e6 / self.tasks.max(1) as f64
    }
    /// Share of the runs' processor time spent outside the tasks' own work (loads, preloads,
    /// scheduling, the pool's bookkeeping): the overhead the oracle does not have. NaN: no time.
    pub fn overhead_share(&self) -> f64 {
        let (work, busy) = self.work_busy_us;
        if busy == 0 { f64::NAN } else { 1.0 - work as f64 / busy as f64 }
    }

    /// Mean latency, s.
    pub fn mean_latency_s(&self) -> f64 {
        self.latency_sum_s / self.tasks.max(1) as f64
    }
    fn add(&mut self, o: &RunOutcome, met: usize, oracle_met: usize, k: usize) {
        self.met += met;
        self.oracle_met += oracle_met;
        self.work_busy_us.0 += o.work.iter().map(|w| w.1).sum::<u64>();
        self.work_busy_us.1 += o.busy_us;
        self.tasks += k;
        self.span_s += o.span_s;
        self.latency_sum_s += o.tasks.iter().map(|t| t.0).sum::<f64>();
        self.frag_sum += o.fragmentation;
        self.runs += 1;
        self.peak = self.peak.max(o.peak_over_budget);
        self.evictions += o.evictions;
        self.compacted_bytes += o.compacted_bytes;
        self.prefetch_us.0 += o.prefetch_us.0;
        self.prefetch_us.1 += o.prefetch_us.1;
    }

    /// Share of the reuse cache's disk prefetch time hidden behind compute (NaN: none prefetched).
    pub fn prefetch_hidden_share(&self) -> f64 {
        if self.prefetch_us.0 == 0 { f64::NAN } else { self.prefetch_us.1 as f64 / self.prefetch_us.0 as f64 }
    }
}

/// The engine config strategy `s` runs under in the sweep (the same budget for every strategy).
pub fn strategy_config(sc: &SweepConfig, student: &VMoe, s: &RealStrategy) -> EngineConfig {
    EngineConfig {
        budget: pool_budget(student, sc.engine.batch, sc.budget_isolated_tasks),
        scheduler: s.scheduler,
        share_backbone: s.share_backbone,
        mechanisms: s.mechanisms,
        reuse_budget: reuse_budget(s, student, sc.engine.batch, sc.budget_isolated_tasks),
        ..sc.engine
    }
}

/// The arrival times of the first `k` tasks of `seed` in the sweep (solo time `solo_s`): K
/// expected within the window, seeded per (seed, K).
pub fn arrivals(sc: &SweepConfig, seed: u64, k: usize, solo_s: f64) -> Vec<u64> {
    let mean_gap_us = sc.window_solo * solo_s * 1e6 / k.max(1) as f64;
    poisson_arrivals(k, mean_gap_us, seed.wrapping_mul(1000).wrapping_add(k as u64))
}

/// The key of strategy `name`'s cells on seed `seed` alone in a [`SweepResult`] (beside the
/// cells summed over seeds under `name`).
pub fn per_seed_key(name: &str, seed: u64) -> String {
    format!("{name}@seed{seed}")
}

/// Every strategy's cells, indexed like [`SweepConfig::ks`].
pub type SweepResult = BTreeMap<String, Vec<Tally>>;

/// Runs every strategy of `strategies` at every K and seed. `jobs_for(seed, k)` gives the first
/// `k` tasks' samples of the seed (the same for every strategy). Cells are summed over seeds under
/// the strategy's name and kept per seed under [`per_seed_key`].
pub fn sweep(
    sc: &SweepConfig,
    student: &VMoe,
    strategies: &[(String, RealStrategy)],
    jobs: &BTreeMap<u64, Vec<Dataset>>,
    solo_s: &BTreeMap<u64, f64>,
) -> Result<SweepResult> {
    let mut out: SweepResult =
        strategies.iter().map(|(n, _)| (n.clone(), vec![Tally::default(); sc.ks.len()])).collect();
    let runs = (sc.seeds.len() * sc.ks.len() * strategies.len()) as u64;
    let bar = troupe::progress::bar(runs, "bench coadapt runs");
    for &seed in &sc.seeds {
        let Some(all) = jobs.get(&seed) else { continue };
        let solo = solo_s.get(&seed).copied().unwrap_or(0.0);
        let l_s = sc.l_solo * solo;
        for (i, &k) in sc.ks.iter().enumerate() {
            let k_jobs = &all[..k.min(all.len())];
            let arrivals = arrivals(sc, seed, k_jobs.len(), solo);
            for (name, s) in strategies {
                let cfg = strategy_config(sc, student, s);
                let slo = Micros((l_s * 1e6) as u64);
                let o = run_once(cfg, student, k_jobs, &arrivals, Some(slo))
                    .with_context(|| format!("{name} at K = {k}, seed {seed}"))?;
                bar.inc(1);
                let met = o.met(sc.gain, l_s);
                let oracle_met = o.oracle_met(&arrivals, sc.gain, slo.0);
                if let Some(c) = out.get_mut(name.as_str()).and_then(|v| v.get_mut(i)) {
                    c.add(&o, met, oracle_met, k_jobs.len());
                }
                let per_seed = out
                    .entry(per_seed_key(name, seed))
                    .or_insert_with(|| vec![Tally::default(); sc.ks.len()]);
                if let Some(c) = per_seed.get_mut(i) {
                    c.add(&o, met, oracle_met, k_jobs.len());
                }
            }
        }
    }
    Ok(out)
}

/// One task alone (isolated, run to completion), the median over a seed's first tasks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Solo {
    /// Time to reach the SLO gain, s (over every task when none reaches it).
    pub seconds: f64,
    /// Epochs trained to reach it (the same fallback).
    pub epochs: f64,
}

/// The median time (and epochs) one task of `jobs` takes alone to reach `gain` (isolated, run to
/// completion), over at most `n` of them; the medians over all of them when none reaches it.
pub fn solo_time(sc: &SweepConfig, student: &VMoe, jobs: &[Dataset], n: usize) -> Result<Solo> {
    let s = RealStrategy::BASELINES[0];
    let cfg = EngineConfig {
        budget: pool_budget(student, sc.engine.batch, sc.budget_isolated_tasks),
        scheduler: s.scheduler,
        share_backbone: s.share_backbone,
        mechanisms: s.mechanisms,
        ..sc.engine
    };
    let (mut reached, mut all) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    for j in jobs.iter().take(n.max(1)) {
        let o = run_once(cfg, student, std::slice::from_ref(j), &[0], None)?;
        for ((t, g), e) in o.tasks.iter().zip(&o.epochs) {
            all.0.push(*t);
            all.1.push(f64::from(*e));
            if *g >= sc.gain - 1e-12 {
                reached.0.push(*t);
                reached.1.push(f64::from(*e));
            }
        }
    }
    let v = if reached.0.is_empty() { &mut all } else { &mut reached };
    Ok(Solo {
        seconds: troupe_policy::stats::median(&mut v.0),
        epochs: troupe_policy::stats::median(&mut v.1),
    })
}

/// The epoch cap of the sweep's tasks: as many epochs as the SLO deadline (`l_solo` solo times)
/// gives one task alone, `l_solo x solo epochs` rounded up, at least `floor`. A task still below
/// its gain after them is about at its deadline even alone and, sharing the pool, past it; every
/// strategy returns it then (the same cap for all of them).
pub fn epoch_cap(l_solo: f64, solo_epochs: f64, floor: u32) -> u32 {
    let cap = (l_solo * solo_epochs).ceil();
    if cap.is_finite() && cap > 0.0 { (cap.min(f64::from(u32::MAX)) as u32).max(floor) } else { floor }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_are_seeded_sorted_and_scale_with_the_rate() {
        let a = poisson_arrivals(200, 1000.0, 5);
        assert_eq!(a, poisson_arrivals(200, 1000.0, 5));
        assert_ne!(a, poisson_arrivals(200, 1000.0, 6));
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // Mean gap of 200 exponential draws: within 30% of 1000 us.
        let mean = *a.last().unwrap() as f64 / 200.0;
        assert!((700.0..1300.0).contains(&mean), "{mean}");
        let fast = poisson_arrivals(200, 100.0, 5);
        assert!(fast.last() < a.last());
    }

    #[test]
    fn the_epoch_cap_is_the_deadlines_worth_of_solo_epochs() {
        assert_eq!(epoch_cap(7.25, 3.0, 4), 22);
        assert_eq!(epoch_cap(7.25, 0.0, 4), 4);
        assert_eq!(epoch_cap(f64::NAN, 3.0, 4), 4);
        assert_eq!(epoch_cap(2.0, 1.0, 1), 2);
    }

    #[test]
    fn max_concurrency_is_the_last_k_of_the_passing_prefix() {
        let ks = [1, 2, 4, 8];
        assert_eq!(max_concurrency(&ks, &[1.0, 0.95, 0.5, 1.0], 0.9), 2);
        assert_eq!(max_concurrency(&ks, &[0.8, 1.0, 1.0, 1.0], 0.9), 0);
        assert_eq!(max_concurrency(&ks, &[1.0; 4], 0.9), 8);
    }

    #[test]
    fn the_in_run_oracle_schedules_the_runs_own_work_by_job() {
        // Finished out of order: job 1 (arrives at 0, 50 us, gains), job 0 (arrives at 10, 60 us,
        // gains), job 2 (arrives at 20, 10 us, never gains). Deadlines 100 us after arrival.
        let o = RunOutcome {
            tasks: vec![(0.0, 0.2), (0.0, 0.3), (0.0, 0.0)],
            work: vec![(1, 50), (0, 60), (2, 10)],
            ..RunOutcome::default()
        };
        let arrivals = [10, 0, 20];
        // EDF: job 1 0-50, job 0 50-110 (deadline 110), job 2 runs but never gains.
        assert_eq!(o.oracle_met(&arrivals, 0.1, 100), 2);
        // A tighter deadline leaves job 0 (which would end at 110 > 10 + 90) out.
        assert_eq!(o.oracle_met(&arrivals, 0.1, 90), 1);
        // A job index with no arrival is left out, never a panic.
        let stray = RunOutcome { work: vec![(7, 5), (0, 60), (2, 10)], ..o };
        assert_eq!(stray.oracle_met(&arrivals, 0.1, 100), 1);
    }

    #[test]
    fn pairwise_agreement_counts_pairs_ranked_alike() {
        assert_eq!(pairwise_agreement(&[3.0, 2.0, 1.0], &[30.0, 20.0, 10.0]), 1.0);
        assert_eq!(pairwise_agreement(&[3.0, 2.0, 1.0], &[10.0, 20.0, 30.0]), 0.0);
        assert!((pairwise_agreement(&[3.0, 2.0, 1.0], &[20.0, 30.0, 10.0]) - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn baselines_merge_only_for_moe_se_and_run_no_mechanism() {
        for b in RealStrategy::BASELINES {
            assert_eq!(b.share_backbone, b.name == "moe_se", "{}", b.name);
            assert_eq!(b.mechanisms, NO_MECHANISMS);
        }
        let ab = RealStrategy::ablations();
        assert_eq!(ab.len(), Mechanisms::NAMES.len() + 2);
        assert!(ab.iter().all(|(_, s)| s.scheduler == SchedulerChoice::Twin && *s != RealStrategy::OURS));
    }
}
