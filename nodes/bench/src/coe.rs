//! `troupe bench coe`: FCFS+LRU against ours and each mechanism alone, and against our scheduling
//! with the paper's plain two-stage eviction (no queue lookahead), on one trace, on this machine,
//! in one run.
//!
//! At `--scale ci` every combination is served for real (ONNX Runtime sessions, `O_DIRECT`
//! loads, one thread per executor). At `--scale paper` serving 20k requests through ~300 real
//! experts does not fit a 2-core CI box, so the trace is replayed through the policy crate's
//! discrete-event simulator driven by the latency model *profiled on this machine* with real
//! loads and real batch runs; the output says so (`real_execution` = 0). `--real` serves every
//! combination for real at any scale (at paper scale FCFS+LRU alone takes about 15 minutes on
//! two cores). Figures of a simulated run carry the prefix `sim_` (all but `real_execution`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use troupe_actors::coe::accuracy::Accuracy;
use troupe_actors::coe::app::{self, App, Scale};
use troupe_actors::coe::profiler;
use troupe_actors::coe::runner::{RunOptions, RunReport, TierOptions, run_local};
use troupe_policy::coe::sweep::{self, Arrivals, Point, PointResult};
use troupe_policy::coe::{
    ExecutorKind, ExpertEngine, LatencyModel, Profile, SchedulerConfig, SimOptions, Tier, choose_engine,
    simulate,
};

use troupe::chart::{Bar, BarChart, BarGroup, BarRow, COLOURS};
use troupe::workloads::coe::{self as cmd, KnobArgs};

/// Reorder window of the bounded-window run of the sweep, tasks.
pub const BOUNDED_WINDOW: u64 = 256;
/// The open-loop run's arrival rate, as a share of ours' saturated throughput.
pub const OPEN_LOOP_SHARE: f64 = 0.5;

/// One policy's figures at a sweep point (real or simulated).
struct Measured {
    throughput: f64,
    loads_over_belady: f64,
    p99_ms: f64,
    outputs: Vec<u64>,
}

fn measure(
    app: &std::sync::Arc<App>,
    latency: &LatencyModel,
    config: SchedulerConfig,
    real: bool,
    arrival_scale: f64,
    tiers: TierOptions,
) -> Result<Measured> {
    if real {
        let options = RunOptions {
            deadline: std::time::Duration::from_secs(3 * 3600),
            arrival_scale,
            tiers,
            ..RunOptions::new(config)
        };
        let r: RunReport = run_local(app, latency, &options)?;
        Ok(Measured {
            throughput: r.throughput_rps,
            loads_over_belady: r.loads_over_belady(),
            p99_ms: r.p99_ms,
            outputs: r.digests,
        })
    } else {
        let mut trace = app.trace.clone();
        for r in &mut trace.requests {
            r.arrival = troupe_policy::Micros((r.arrival.0 as f64 * arrival_scale).round() as u64);
        }
        let r = simulate(&trace, latency, config, &SimOptions::default())?;
        Ok(Measured {
            throughput: r.throughput_rps,
            loads_over_belady: r.loads_over_belady(),
            p99_ms: r.latency_p99.0 as f64 / 1e3,
            outputs: r.outputs,
        })
    }
}

/// `troupe bench coe --sweep`: at every device budget of [`sweep::SWEEP_BUDGETS`] x skew of
/// [`sweep::SWEEP_SKEWS`], FCFS+LRU, the paper's two-stage and ours on the app's experts (one
/// generated app; the trace is reshaped per point from its recorded walks, the profile's
/// budgets replaced). Real execution at ci scale (or with `--real`), else simulated with this
/// machine's profile and every key `sim_`. Then, at the app's own point: ours at a bounded
/// reorder window ([`BOUNDED_WINDOW`]) beside the default one, and FCFS+LRU and ours open-loop
/// at [`OPEN_LOOP_SHARE`] of ours' saturated throughput.
///
/// Keys: those of [`sweep::sweep_figures`]; `window<N>_{throughput_rps,p99_latency_ms}` for
/// both windows; `open_loop_rate_rps`, `open_loop_{ours,fcfs_lru}_{throughput_rps,
/// p99_latency_ms}`; each `sim_`-prefixed when simulated.
pub fn run_sweep(
    scale_name: &str,
    dir: Option<PathBuf>,
    force_real: bool,
    knobs: &KnobArgs,
) -> Result<BTreeMap<String, f64>> {
    let scale = cmd::scale(scale_name)?;
    let (app, profile) = prepare(scale, dir, knobs)?;
    let real = force_real || scale == Scale::Ci;
    let pre = prefix(real);
    // The executors' host tiers get the --host-budget share of all expert bytes.
    let tiers = TierOptions { host_budget: knobs.host_budget, ..TierOptions::default() };
    let mut points = Vec::new();
    let bar = troupe::progress::bar(
        (sweep::SWEEP_BUDGETS.len() * sweep::SWEEP_SKEWS.len()) as u64,
        "bench coe points",
    );
    for &budget in &sweep::SWEEP_BUDGETS {
        for &skew in &sweep::SWEEP_SKEWS {
            let (trace, p, effective) = reshaped(&app, &profile, Some(budget), Some(skew), knobs)?;
            let latency = LatencyModel::from_profile(&p)?;
            let point_app = std::sync::Arc::new(with_trace(&app, trace));
            let base = measure(&point_app, &latency, SchedulerConfig::fcfs_lru(), real, 1.0, tiers)?;
            let paper = measure(&point_app, &latency, SchedulerConfig::paper_two_stage(), real, 1.0, tiers)?;
            let ours = measure(&point_app, &latency, SchedulerConfig::ours(), real, 1.0, tiers)?;
            if base.outputs != paper.outputs || base.outputs != ours.outputs {
                bail!("request outputs differ between policies at {}", sweep::point_key(budget, skew));
            }
            let r = PointResult {
                budget,
                effective_budget: effective,
                skew,
                fcfs_lru_rps: base.throughput,
                ours_over_fcfs_lru: ours.throughput / base.throughput.max(1e-9),
                paper_over_fcfs_lru: paper.throughput / base.throughput.max(1e-9),
                ours_loads_over_belady: ours.loads_over_belady,
                paper_loads_over_belady: paper.loads_over_belady,
                real,
            };
            bar.inc(1);
            troupe::progress::println(format!(
                "sweep {}: ours {:.2}x, paper {:.2}x over fcfs+lru ({:.1} req/s); loads/MIN ours {:.2}x paper {:.2}x",
                sweep::point_key(budget, skew),
                r.ours_over_fcfs_lru,
                r.paper_over_fcfs_lru,
                r.fcfs_lru_rps,
                r.ours_loads_over_belady,
                r.paper_loads_over_belady
            ));
            points.push(r);
        }
    }
    bar.finish_and_clear();
    let mut f = sweep::sweep_figures(&points);
    print!("{}", sweep::sweep_table(&points));
    // At the app's own point (its recorded budget, skew and rate, or those knobs given).
    let (trace, p, _) = reshaped(&app, &profile, knobs.device_budget, knobs.zipf, knobs)?;
    let latency = LatencyModel::from_profile(&p)?;
    let own = std::sync::Arc::new(with_trace(&app, trace));
    let mut outputs = None;
    for window in [SchedulerConfig::DEFAULT_WINDOW, BOUNDED_WINDOW] {
        let config = SchedulerConfig { window_tasks: window, ..SchedulerConfig::ours() };
        let m = measure(&own, &latency, config, real, 1.0, tiers)?;
        if outputs.get_or_insert_with(|| m.outputs.clone()) != &m.outputs {
            bail!("request outputs differ between reorder windows");
        }
        println!("window {window:>5}: ours {:.1} req/s, p99 {:.1} ms", m.throughput, m.p99_ms);
        f.insert(format!("{pre}window{window}_throughput_rps"), m.throughput);
        f.insert(format!("{pre}window{window}_p99_latency_ms"), m.p99_ms);
    }
    let saturated = f[&format!("{pre}window{}_throughput_rps", SchedulerConfig::DEFAULT_WINDOW)];
    let target = OPEN_LOOP_SHARE * saturated;
    let span_s = own.trace.requests.last().map_or(0.0, |r| r.arrival.0 as f64 / 1e6);
    let trace_rate = own.trace.requests.len() as f64 / span_s.max(1e-9);
    let arrival_scale = trace_rate / target.max(1e-9);
    f.insert(format!("{pre}open_loop_rate_rps"), target);
    for (name, config) in [("fcfs_lru", SchedulerConfig::fcfs_lru()), ("ours", SchedulerConfig::ours())] {
        let m = measure(&own, &latency, config, real, arrival_scale, tiers)?;
        println!("open loop at {target:.1} req/s: {name} {:.1} req/s, p99 {:.1} ms", m.throughput, m.p99_ms);
        f.insert(format!("{pre}open_loop_{name}_throughput_rps"), m.throughput);
        f.insert(format!("{pre}open_loop_{name}_p99_latency_ms"), m.p99_ms);
    }
    f.insert("real_execution".into(), if real { 1.0 } else { 0.0 });
    f.insert("requests".into(), app.trace.requests.len() as f64);
    f.insert("experts".into(), app.trace.model.len() as f64);
    Ok(f)
}

/// One policy combination's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Label (`fcfs+lru`, `sched-only`, `evict-only`, `paper-two-stage`, `ours`).
    pub label: &'static str,
    /// Requests per second.
    pub throughput: f64,
    /// Expert loads.
    pub loads: u64,
    /// Loads over Belady's MIN on the same served order.
    pub loads_over_belady: f64,
    /// Share of busy time spent loading.
    pub switch_share: f64,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Seconds executors spent running batches (busy minus switching), summed.
    pub compute_s: f64,
    /// Tier and overhead figures (real execution only).
    pub tiers: Option<TierFigures>,
}

/// What the executors' tiers did and what deciding cost, in one real run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierFigures {
    /// Time in the policy's scheduler calls over executor busy time.
    pub scheduling_share: f64,
    /// Executors' expert-management time over busy time.
    pub management_share: f64,
    /// Executors' device-arena compaction time over busy time.
    pub compaction_share: f64,
    /// Tier-copy time per byte of a host promotion over that of a disk load (NaN if either is
    /// missing).
    pub promotion_over_disk: f64,
    /// Promotions from the host tier.
    pub promotions: u64,
    /// Loads from disk.
    pub disk_loads: u64,
    /// Evicted experts kept in the host tier.
    pub demotions: u64,
    /// Evicted experts dropped to disk.
    pub drops: u64,
    /// Host experts evicted to disk for a demotion.
    pub host_evictions: u64,
    /// Device-arena compactions.
    pub compactions: u64,
    /// Loads whose MLP engine read the weights in place from the device arena.
    pub in_arena_loads: u64,
    /// Highest host-tier bytes of any executor.
    pub peak_host_bytes: u64,
}

impl TierFigures {
    /// The figures of one real run.
    pub fn of(r: &RunReport) -> Self {
        let sum = |f: fn(&troupe_actors::coe::executor::ExecutorCounters) -> u64| -> u64 {
            r.executors.iter().map(|(_, c)| f(c)).sum()
        };
        TierFigures {
            scheduling_share: r.scheduling_share(),
            management_share: r.management_share(),
            compaction_share: r.compaction_share(),
            promotion_over_disk: r.host_promotion_over_disk_load(),
            promotions: sum(|c| c.promotions),
            disk_loads: sum(|c| c.disk_loads),
            demotions: sum(|c| c.demotions),
            drops: sum(|c| c.drops),
            host_evictions: sum(|c| c.host_evictions),
            compactions: sum(|c| c.compactions),
            in_arena_loads: sum(|c| c.in_arena_loads),
            peak_host_bytes: r.executors.iter().map(|(_, c)| c.peak_host_bytes).max().unwrap_or(0),
        }
    }

    /// One line for the table.
    pub fn line(&self) -> String {
        format!(
            "    tiers: {} promotions ({:.2}x disk time/byte), {} disk loads, {} demotions, {} drops, {} host evictions, {} compactions; of busy: scheduling {:.2}%, management {:.3}%, compaction {:.3}%",
            self.promotions,
            self.promotion_over_disk,
            self.disk_loads,
            self.demotions,
            self.drops,
            self.host_evictions,
            self.compactions,
            100.0 * self.scheduling_share,
            100.0 * self.management_share,
            100.0 * self.compaction_share
        )
    }
}

/// The app of `scale` in `dir` (generated with `knobs` if missing, or if it is the scale's
/// default folder and an older troupe generated it; refused if a folder of the user's is
/// stale, or if its recorded expert count or sizes differ from the ones asked) and this
/// machine's profile of it.
fn prepare(scale: Scale, dir: Option<PathBuf>, knobs: &KnobArgs) -> Result<(App, Profile)> {
    let own_folder = dir.is_none();
    let dir = cmd::app_dir(scale, dir);
    if !dir.join("app.txt").is_file() {
        cmd::gen_app(&dir, scale, 1, &knobs.gen_knobs())?;
    }
    let mut app = App::open(&dir, None)?;
    let made_by = app.manifest.generator;
    if made_by != Some(app::GENERATOR) {
        let made_by = made_by.map_or_else(|| "none recorded".to_string(), |g| g.to_string());
        if !own_folder {
            bail!(
                "{} was generated by another troupe (generator {made_by}, this one trains {}): its experts and accuracy are not this version's; regenerate it with `troupe coe gen --dir {}` or pass a fresh --dir",
                dir.display(),
                app::GENERATOR,
                dir.display()
            );
        }
        println!(
            "coe bench: {} was generated by another troupe (generator {made_by}, this one trains {}); regenerating",
            dir.display(),
            app::GENERATOR
        );
        cmd::gen_app(&dir, scale, 1, &knobs.gen_knobs())?;
        app = App::open(&dir, None)?;
    }
    let profile_path = dir.join("profile.txt");
    if !profile_path.is_file() {
        cmd::profile_app(&dir, &profile_path)?;
    }
    let profile = profiler::load_profile(&profile_path)
        .with_context(|| "re-run `troupe coe profile` on this machine (or delete the file)".to_string())?;
    if knobs.experts.is_some() || knobs.min_bytes.is_some() || knobs.max_bytes.is_some() {
        let Some(k) = app.manifest.knobs else {
            bail!(
                "{} records no knobs; pass a fresh --dir to generate one with --experts/--min-bytes/--max-bytes",
                dir.display()
            );
        };
        let asked = [knobs.min_bytes.map(|b| b == k.min_bytes), knobs.max_bytes.map(|b| b == k.max_bytes)];
        // The generator rounds the entry-expert count, so the count is "about" the one asked.
        let experts_off = knobs.experts.is_some_and(|n| n.abs_diff(k.experts) * 4 > n);
        if asked.contains(&Some(false)) || experts_off {
            bail!(
                "{} was generated with {} experts of {}-{} bytes; pass a fresh --dir for other expert counts or sizes",
                dir.display(),
                k.experts,
                k.min_bytes,
                k.max_bytes
            );
        }
    }
    Ok((app, profile))
}

/// The app's recorded knob values, or the scale's for an app generated before knobs.
fn recorded(app: &App) -> (f64, f64, f64) {
    let trace = &app.trace;
    let total = trace.model.total_bytes().max(1) as f64;
    let host: u64 = trace.model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum();
    match app.manifest.knobs {
        Some(k) => (k.zipf, k.host_budget, k.rate_rps),
        None => {
            let c = app.manifest.scale.config();
            (c.model.zipf, host as f64 / total, c.rate_rps())
        }
    }
}

/// `app`'s trace and `profile` reshaped to the budget, skew, host budget and rate given (each
/// absent keeps the app's). Returns the trace, the profile and the device budget really given.
fn reshaped(
    app: &App,
    profile: &Profile,
    device_budget: Option<f64>,
    zipf: Option<f64>,
    knobs: &KnobArgs,
) -> Result<(troupe_policy::coe::Trace, Profile, f64)> {
    let (z0, h0, r0) = recorded(app);
    let cfg = app.manifest.scale.config();
    let trace = if zipf.is_none()
        && knobs.host_budget.is_none()
        && knobs.rate.is_none()
        && knobs.requests.is_none()
        && knobs.trace_seed.is_none()
    {
        app.trace.clone()
    } else {
        let point = Point {
            zipf: zipf.unwrap_or(z0),
            host_budget: knobs.host_budget.unwrap_or(h0).max(f64::MIN_POSITIVE),
            arrivals: Arrivals {
                rate_rps: knobs.rate.unwrap_or(r0),
                burst_prob: cfg.burst_prob,
                burst_max: cfg.burst_max,
            },
            requests: knobs.requests.map_or(app.trace.requests.len(), |n| n as usize),
            seed: knobs.trace_seed.unwrap_or(1),
        };
        sweep::reshape(&app.trace, &point)?
    };
    let total = trace.model.total_bytes().max(1) as f64;
    match device_budget {
        Some(b) => {
            let (bytes, effective) = sweep::budget_bytes(&trace.model, b);
            Ok((trace, sweep::with_device_budget(profile, bytes), effective))
        }
        None => {
            let bytes = profile.executors.first().map_or(0, |e| e.expert_memory_bytes);
            Ok((trace, profile.clone(), bytes as f64 / total))
        }
    }
}

/// `app` serving `trace` instead of its own.
fn with_trace(app: &App, trace: troupe_policy::coe::Trace) -> App {
    App {
        dir: app.dir.clone(),
        manifest: app.manifest.clone(),
        trace,
        digits: app.digits.clone(),
        routes: app.routes.clone(),
    }
}

/// How `bench coe` serves: real or simulated, the CPU executor's engine, which combinations.
#[derive(Clone, Copy, Debug)]
pub struct ServeOptions {
    /// Serve for real even at paper scale (ci always is).
    pub force_real: bool,
    /// ONNX Runtime intra-op threads of the CPU executor's sessions.
    pub cpu_threads: usize,
    /// The CPU executor's experts in the kernels' MLP engine instead of ONNX Runtime.
    pub cpu_mlp: bool,
    /// Leave out the two one-mechanism ablations (sched-only, evict-only).
    pub skip_ablation: bool,
}

/// The combinations `options` serves, baseline first.
fn served(options: &ServeOptions) -> Vec<SchedulerConfig> {
    let [_, sched_only, evict_only, _] = SchedulerConfig::combinations();
    compared()
        .into_iter()
        .filter(|c| !(options.skip_ablation && [sched_only, evict_only].contains(c)))
        .collect()
}

/// Run the benchmark; returns the flat figures. Writes the SVG to `svg`.
pub fn run(
    scale_name: &str,
    dir: Option<PathBuf>,
    svg: &Path,
    knobs: &KnobArgs,
    options: &ServeOptions,
) -> Result<BTreeMap<String, f64>> {
    let ServeOptions { force_real, cpu_threads, cpu_mlp, .. } = *options;
    let scale = cmd::scale(scale_name)?;
    let (app, profile) = prepare(scale, dir, knobs)?;
    let (trace, profile, effective) = reshaped(&app, &profile, knobs.device_budget, knobs.zipf, knobs)?;
    let latency = LatencyModel::from_profile(&profile)?;
    let app = std::sync::Arc::new(with_trace(&app, trace));
    let real = force_real || scale == Scale::Ci;
    let mut rows = Vec::new();
    let mut digests: Option<Vec<u64>> = None;
    let mut identical = true;
    // Requests whose outputs differ from the first combination's, worst over the combinations.
    let mut differing = 0usize;
    // What each kind of executor ran on (the last real run's executors; the profile's otherwise).
    let mut engines = profiled_engines(&latency);
    let configs = served(options);
    let bar = troupe::progress::bar(configs.len() as u64, "bench coe policies");
    for config in configs {
        bar.inc(1);
        let row = if real {
            // The executors' host tiers get the --host-budget share of all expert bytes.
            let tiers = TierOptions {
                host_budget: knobs.host_budget,
                cpu_threads,
                cpu_mlp,
                ..TierOptions::default()
            };
            let options = RunOptions {
                deadline: std::time::Duration::from_secs(3 * 3600),
                tiers,
                ..RunOptions::new(config)
            };
            let r = run_local(&app, &latency, &options)?;
            engines = executor_engines(&r, &latency);
            troupe::progress::println(format!("{}\n{}", cmd::run_line(&r), TierFigures::of(&r).line()));
            match &digests {
                None => digests = Some(r.digests.clone()),
                Some(d) => {
                    identical &= *d == r.digests;
                    differing = differing.max(d.iter().zip(&r.digests).filter(|(a, b)| a != b).count());
                }
            }
            Row {
                label: r.label,
                throughput: r.throughput_rps,
                loads: r.loads,
                loads_over_belady: r.loads_over_belady(),
                switch_share: r.switch_share(),
                p50_ms: r.p50_ms,
                p99_ms: r.p99_ms,
                compute_s: r.busy_s - r.switch_s,
                tiers: Some(TierFigures::of(&r)),
            }
        } else {
            let r = simulate(&app.trace, &latency, config, &SimOptions::default())?;
            match &digests {
                None => digests = Some(r.outputs.clone()),
                Some(d) => identical &= *d == r.outputs,
            }
            let row = Row {
                label: r.label,
                throughput: r.throughput_rps,
                loads: r.loads,
                loads_over_belady: r.loads_over_belady(),
                switch_share: r.switch_share,
                p50_ms: r.latency_p50.0 as f64 / 1e3,
                p99_ms: r.latency_p99.0 as f64 / 1e3,
                compute_s: r.busy.0.saturating_sub(r.switching.0) as f64 / 1e6,
                tiers: None,
            };
            troupe::progress::println(format!(
                "{:<15} {:>7.1} req/s  loads {:>5} ({:.2}x belady)  switching {:>4.1}%  p50 {:>7.1} ms  p99 {:>7.1} ms  [simulated, profiled latencies]",
                row.label,
                row.throughput,
                row.loads,
                row.loads_over_belady,
                100.0 * row.switch_share,
                row.p50_ms,
                row.p99_ms
            ));
            row
        };
        rows.push(row);
    }
    bar.finish_and_clear();
    // A CUDA executor agrees with the CPU's only to float tolerance (cuBLAS picks its kernels by
    // batch shape, and outputs are compared quantised to 1e-4 steps), so which executor served a
    // request, and in what batch, can flip a digit: reported, not refused. Without CUDA every
    // engine computes the same bits and any difference is a bug.
    let cuda = engines.0.is_some_and(|g| g.on_cuda());
    if !identical && !cuda {
        bail!("request outputs differ between policies");
    }
    if !identical {
        println!(
            "outputs: {differing} of {} requests differ in some digit between combinations (the GPU executor runs on CUDA: outputs agree to float tolerance, checked by actors/tests/coe_engines.rs)",
            app.trace.requests.len()
        );
    }
    let mut f = policy_figures(&rows, real);
    f.insert(format!("{}outputs_identical", prefix(real)), if identical { 1.0 } else { 0.0 });
    f.insert(format!("{}outputs_differing_requests", prefix(real)), differing as f64);
    f.insert("requests".into(), app.trace.requests.len() as f64);
    f.insert("experts".into(), app.trace.model.len() as f64);
    f.insert("expert_bytes_total".into(), app.trace.model.total_bytes() as f64);
    f.insert("device_budget_fraction".into(), effective);
    f.insert("cpu_threads".into(), cpu_threads as f64);
    let a = accuracies(&app.dir);
    f.insert("coe_accuracy".into(), a.coe_accuracy);
    f.insert("single_model_accuracy".into(), a.single_model_accuracy);
    f.insert("coe_routed_share".into(), a.routed_share);
    f.insert("coe_accuracy_when_routed".into(), a.accuracy_when_routed);
    engine_figures(&mut f, engines);
    if let Some(ours) = rows.iter().find(|r| r.label == "ours") {
        // The floor of the switching share on this trace: every expert it uses loaded exactly
        // once (at the first executor's profiled bandwidth), against ours' compute time.
        let mut used = std::collections::BTreeSet::new();
        for r in &app.trace.requests {
            used.extend(r.experts());
        }
        let once: f64 = used
            .iter()
            .filter_map(|e| app.trace.model.expert(*e))
            .map(|e| latency.load_time(0, e.size_bytes, e.home).0 as f64 / 1e6)
            .sum();
        f.insert(
            format!("{}switch_share_floor_one_load_each", prefix(real)),
            once / (once + ours.compute_s).max(1e-9),
        );
    }
    let title = format!(
        "troupe bench coe --scale {} ({}; executors {})",
        scale.name(),
        if real { "real execution" } else { "simulated with latencies profiled on this machine" },
        profile.executors.iter().map(|e| e.name.as_str()).collect::<Vec<_>>().join(", ")
    );
    troupe::workloads::coe::app_write(svg, &svg_plot(&title, &rows))?;
    println!("plot written to {}", svg.display());
    Ok(f)
}

/// The app's recorded held-out accuracies (CoE, single model of the same bytes, how well the
/// preliminaries route), printed; NaN for an app generated before its experts were trained (no
/// `accuracy.txt`).
fn accuracies(dir: &Path) -> Accuracy {
    match Accuracy::read(dir) {
        Ok(a) => {
            println!(
                "accuracy on {} held-out digits: CoE {:.4}, single model of the same bytes ({:.1} MB) {:.4}; routed to the digit's group {:.1}%, CoE right on those {:.4}",
                a.test_images,
                a.coe_accuracy,
                a.single_model_bytes as f64 / 1e6,
                a.single_model_accuracy,
                100.0 * a.routed_share,
                a.accuracy_when_routed
            );
            a
        }
        Err(e) => {
            println!("accuracy: not recorded ({e}); regenerate the app with `troupe coe gen`");
            Accuracy {
                coe_accuracy: f64::NAN,
                single_model_accuracy: f64::NAN,
                single_model_bytes: 0,
                expert_bytes: 0,
                train_images: 0,
                calibration_images: 0,
                test_images: 0,
                epochs: 0,
                routed_share: f64::NAN,
                accuracy_when_routed: f64::NAN,
            }
        }
    }
}

/// The engines of the GPU and the CPU executor (`None` where the profile has no such executor).
type Engines = (Option<ExpertEngine>, Option<ExpertEngine>);

/// The engines the executors of `r` recorded, by kind.
fn executor_engines(r: &RunReport, latency: &LatencyModel) -> Engines {
    let of = |kind: ExecutorKind| {
        (0..latency.executors())
            .find(|&e| latency.kind(e) == kind)
            .and_then(|e| r.executors.get(e))
            .and_then(|(_, c)| c.engine)
    };
    (of(ExecutorKind::Gpu), of(ExecutorKind::Cpu))
}

/// The engines a simulated run's profile was measured with: the profiler opens each executor with
/// the engine the policy picks on this machine (the profile is tied to whether CUDA is usable),
/// the CPU executor on ONNX Runtime.
fn profiled_engines(latency: &LatencyModel) -> Engines {
    let cuda = troupe_kernels::cuda::cuda_available(0).is_ok();
    let has = |kind: ExecutorKind| (0..latency.executors()).any(|e| latency.kind(e) == kind);
    let gpu = has(ExecutorKind::Gpu).then(|| choose_engine(ExecutorKind::Gpu, cuda, false));
    let cpu = has(ExecutorKind::Cpu).then(|| choose_engine(ExecutorKind::Cpu, cuda, false));
    (gpu, cpu)
}

/// `gpu_executor_engine_cuda` (1 when the GPU executor ran on CUDA, 0 for the `standin-cpu`) and
/// `cpu_executor_engine_mlp` (1 when the CPU executor ran the MLP engine); the labels are printed.
fn engine_figures(f: &mut BTreeMap<String, f64>, (gpu, cpu): Engines) {
    if let Some(g) = gpu {
        println!("gpu executor engine: {}", g.label());
        f.insert("gpu_executor_engine_cuda".into(), if g.on_cuda() { 1.0 } else { 0.0 });
    }
    if let Some(c) = cpu {
        println!("cpu executor engine: {}", c.label());
        f.insert("cpu_executor_engine_mlp".into(), if c.uses_onnx_runtime() { 0.0 } else { 1.0 });
    }
}

/// Key prefix of the policy figures: none for real execution, `sim_` for the simulator's.
fn prefix(real: bool) -> &'static str {
    if real { "" } else { "sim_" }
}

/// The per-combination figures (`{label}_*`, labels with `+` and `-` as `_`), the headline ratios
/// over the first row (FCFS+LRU) and `real_execution`. Ours gives `throughput_over_fcfs_lru` and
/// the unprefixed summary; our scheduling with the paper's plain two stages gives
/// `paper_two_stage_over_fcfs_lru`. Every key but `real_execution` starts with `sim_` when the
/// rows come from the simulator.
pub fn policy_figures(rows: &[Row], real: bool) -> BTreeMap<String, f64> {
    let p = prefix(real);
    let base = rows.first().map_or(1.0, |r| r.throughput.max(1e-9));
    let mut f = BTreeMap::new();
    f.insert("real_execution".into(), if real { 1.0 } else { 0.0 });
    f.insert(format!("{p}outputs_identical"), 1.0);
    for r in rows {
        let k = r.label.replace(['+', '-'], "_");
        f.insert(format!("{p}{k}_throughput_rps"), r.throughput);
        f.insert(format!("{p}{k}_over_fcfs_lru"), r.throughput / base);
        f.insert(format!("{p}{k}_loads"), r.loads as f64);
        f.insert(format!("{p}{k}_loads_over_belady"), r.loads_over_belady);
        f.insert(format!("{p}{k}_switch_share"), r.switch_share);
        f.insert(format!("{p}{k}_p50_latency_ms"), r.p50_ms);
        f.insert(format!("{p}{k}_p99_latency_ms"), r.p99_ms);
    }
    if let Some(paper) = rows.iter().find(|r| r.label == SchedulerConfig::paper_two_stage().label()) {
        f.insert(format!("{p}paper_two_stage_over_fcfs_lru"), paper.throughput / base);
    }
    if let Some(ours) = rows.iter().find(|r| r.label == SchedulerConfig::ours().label()) {
        f.insert(format!("{p}throughput_over_fcfs_lru"), ours.throughput / base);
        f.insert(format!("{p}loads_over_belady"), ours.loads_over_belady);
        f.insert(format!("{p}switch_share"), ours.switch_share);
        f.insert(format!("{p}p50_latency_ms"), ours.p50_ms);
        f.insert(format!("{p}p99_latency_ms"), ours.p99_ms);
        if let Some(t) = ours.tiers {
            tier_figures(&mut f, "", &t);
        }
    }
    for r in rows {
        if let Some(t) = r.tiers {
            tier_figures(&mut f, &format!("{}_", r.label.replace(['+', '-'], "_")), &t);
        }
    }
    f
}

/// The tier and overhead keys of one run, each prefixed by `pre` (NaN ratios left out).
fn tier_figures(f: &mut BTreeMap<String, f64>, pre: &str, t: &TierFigures) {
    if t.promotion_over_disk.is_finite() {
        f.insert(format!("{pre}host_promotion_over_disk_load"), t.promotion_over_disk);
    }
    f.insert(format!("{pre}scheduling_overhead_share"), t.scheduling_share);
    f.insert(format!("{pre}management_overhead_share"), t.management_share);
    f.insert(format!("{pre}compaction_share"), t.compaction_share);
    for (k, v) in [
        ("host_promotions", t.promotions),
        ("disk_loads", t.disk_loads),
        ("demotions", t.demotions),
        ("drops_to_disk", t.drops),
        ("host_evictions", t.host_evictions),
        ("compactions", t.compactions),
        ("engine_in_arena_loads", t.in_arena_loads),
        ("peak_host_bytes", t.peak_host_bytes),
    ] {
        f.insert(format!("{pre}{k}"), v as f64);
    }
}

/// The combinations the benchmark serves, baseline first: the four of the ablation with our
/// scheduling and the paper's plain two stages before ours.
pub fn compared() -> [SchedulerConfig; 5] {
    let [fcfs_lru, sched_only, evict_only, ours] = SchedulerConfig::combinations();
    [fcfs_lru, sched_only, evict_only, SchedulerConfig::paper_two_stage(), ours]
}

/// The plot ([`troupe::chart::BarChart`]): throughput over FCFS+LRU and loads over Belady per
/// combination, two bars each.
pub fn svg_plot(title: &str, rows: &[Row]) -> String {
    let base = rows.first().map_or(1.0, |r| r.throughput.max(1e-9));
    let (throughput, loads) = (COLOURS[2], COLOURS[4]);
    let bar = |end: f64, fill: &str, label: String| Bar {
        start: 0.0,
        end,
        fill: fill.into(),
        label,
        tooltip: String::new(),
    };
    let bars: Vec<BarRow> = rows
        .iter()
        .flat_map(|r| {
            let ratio = r.throughput / base;
            let switching = format!("{:.2}x ({:.0}% switching)", r.loads_over_belady, 100.0 * r.switch_share);
            [
                BarRow { name: r.label.into(), bars: vec![bar(ratio, throughput, format!("{ratio:.2}x"))] },
                BarRow { name: String::new(), bars: vec![bar(r.loads_over_belady, loads, switching)] },
            ]
        })
        .collect();
    let longest = bars.iter().flat_map(|r| &r.bars).map(|b| b.end).fold(1.0, f64::max);
    BarChart {
        title: title.into(),
        legend: vec![
            (throughput.into(), "throughput / FCFS+LRU".into()),
            (loads.into(), "loads / Belady MIN".into()),
        ],
        // room right of the longest bar for its label
        x_range: (0.0, 1.25 * longest),
        x_ticks: Vec::new(),
        groups: vec![BarGroup { title: String::new(), rows: bars }],
        notes: Vec::new(),
    }
    .render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipping_the_ablation_serves_the_baseline_the_paper_and_ours() {
        let options =
            ServeOptions { force_real: false, cpu_threads: 1, cpu_mlp: false, skip_ablation: false };
        let labels = |o: &ServeOptions| served(o).iter().map(|c| c.label()).collect::<Vec<_>>();
        assert_eq!(labels(&options), ["fcfs+lru", "sched-only", "evict-only", "paper-two-stage", "ours"]);
        let skip = ServeOptions { skip_ablation: true, ..options };
        assert_eq!(labels(&skip), ["fcfs+lru", "paper-two-stage", "ours"]);
    }

    fn row(label: &'static str, throughput: f64) -> Row {
        Row {
            label,
            throughput,
            loads: 10,
            loads_over_belady: 1.5,
            switch_share: 0.5,
            p50_ms: 1.0,
            p99_ms: 2.0,
            compute_s: 1.0,
            tiers: None,
        }
    }

    fn rows() -> Vec<Row> {
        compared().iter().zip([10.0, 20.0, 15.0, 30.0, 40.0]).map(|(c, t)| row(c.label(), t)).collect()
    }

    #[test]
    fn both_two_stage_variants_are_reported_over_fcfs_lru() {
        let labels: Vec<&str> = compared().iter().map(|c| c.label()).collect();
        assert_eq!(labels, ["fcfs+lru", "sched-only", "evict-only", "paper-two-stage", "ours"]);
        let f = policy_figures(&rows(), true);
        assert_eq!(f["paper_two_stage_over_fcfs_lru"], 3.0);
        assert_eq!(f["throughput_over_fcfs_lru"], 4.0);
        assert_eq!(f["ours_over_fcfs_lru"], 4.0);
        assert_eq!(f["fcfs_lru_over_fcfs_lru"], 1.0);
        assert_eq!(f["real_execution"], 1.0);
        assert!(f.keys().all(|k| !k.starts_with("sim_")));
    }

    #[test]
    fn tier_figures_are_keyed_per_policy_and_for_ours() {
        let t = TierFigures {
            scheduling_share: 0.02,
            management_share: 0.001,
            compaction_share: 0.003,
            promotion_over_disk: f64::NAN,
            promotions: 3,
            disk_loads: 4,
            demotions: 5,
            drops: 1,
            host_evictions: 2,
            compactions: 1,
            in_arena_loads: 6,
            peak_host_bytes: 100,
        };
        let mut rs = rows();
        for r in &mut rs {
            r.tiers = Some(t);
        }
        let f = policy_figures(&rs, true);
        assert_eq!(f["scheduling_overhead_share"], 0.02);
        assert_eq!(f["ours_management_overhead_share"], 0.001);
        assert_eq!(f["fcfs_lru_host_evictions"], 2.0);
        assert_eq!(f["engine_in_arena_loads"], 6.0);
        assert_eq!(f["paper_two_stage_demotions"], 5.0);
        assert!(!f.contains_key("host_promotion_over_disk_load"), "a NaN ratio is left out");
        rs[4].tiers = Some(TierFigures { promotion_over_disk: 0.25, ..t });
        assert_eq!(policy_figures(&rs, true)["host_promotion_over_disk_load"], 0.25);
    }

    #[test]
    fn the_plot_has_two_bars_per_combination_over_fcfs_lru_and_belady() {
        let svg = svg_plot("coe <ci>", &rows());
        assert_eq!(svg.matches("<rect ").count(), 1 + 2 + 2 * 5, "background, legend, two bars each");
        assert!(svg.contains(">4.00x</text>") && svg.contains(">1.50x (50% switching)</text>"), "{svg}");
        assert!(svg.contains("coe &lt;ci&gt;") && svg.contains(">paper-two-stage</text>"), "{svg}");
    }

    #[test]
    fn simulated_figures_carry_the_sim_prefix() {
        let f = policy_figures(&rows(), false);
        assert_eq!(f["sim_paper_two_stage_over_fcfs_lru"], 3.0);
        assert_eq!(f["sim_throughput_over_fcfs_lru"], 4.0);
        assert_eq!(f["real_execution"], 0.0);
        assert!(f.keys().all(|k| k == "real_execution" || k.starts_with("sim_")), "{f:?}");
    }
}
