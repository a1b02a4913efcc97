//! Measured: the reuse cache at an edge device's storage bandwidth (issue 43, item 6; the seed's
//! §3.3: I/O-hiding prefetch and residency against FoggyCache, 86.9% less I/O stall).
//!
//! 1. **What a reuse saves**: the CPU time of the stem (patch embedding and block 0's attention)
//!    per image, the median of five passes over one batch of the student.
//! 2. **What a read costs unthrottled**: the wall time of one entry's `O_DIRECT` read from a slot
//!    file next to the reuse directory (median of 64), the storage's own latency.
//! 3. **The throttle**: [`read_bps_for`] picks the bandwidth at which one un-hidden read costs
//!    [`SEED_READ_OVER_COMPUTE`] (25 s / 35 s) of the compute it saves; the edge's reuse cache reads
//!    at it through the kernel's blkio throttle (`EngineConfig::storage_read_bps`). The bench fails,
//!    saying why, where the throttle cannot be set (never a silent unthrottled run). Where this
//!    machine's storage already reads slower than that target no throttle can reach it: the
//!    throttle is then [`BOARD_READ_BPS`], the board's bandwidth, and the ratio is what it is.
//! 4. **Ours against FoggyCache-like**, on the same tasks, arrivals and batches in the same run:
//!    `ours` (prefetch behind compute, importance-aware residency) and `foggycache` (reuse without
//!    prefetch or residency: `EngineConfig::reuse_on_demand`). Each one's I/O stall is the wall
//!    time its steps were blocked on reads (`ReuseStats::stall_us`), charged on the bench's clock.
//!
//! `ours-small` is ours with the memory tier of one batch (`reuse_budget` 0, no bytes from merging),
//! where residency holds little and prefetch must hide the reads.
//!
//! Figures: `measured_io_stall_reduction_over_foggycache` = 1 - stall_ours / stall_foggycache;
//! `measured_unhidden_read_over_compute_saved` = FoggyCache's stall per entry read (every one of
//! its reads is un-hidden) over the compute one reuse saves; `measured_reuse_net_gain_per_step_ms`
//! = (reuses x compute saved per reuse - stall) / steps for ours (and `_foggycache` for it).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use troupe_actors::coadapt::engine::EngineConfig;
use troupe_kernels::slot_file::SlotFile;
use troupe_kernels::vmoe::VMoe;
use troupe_kernels::vmoe::train::Dataset;
use troupe_policy::adapt::storage::{SEED_READ_OVER_COMPUTE, check_read_bps, read_bps_for};

use super::real::{self, RealStrategy, RunOutcome, SweepConfig};

/// The comparison's headline keys (every one written by [`run`]).
pub const HEADLINE_KEYS: [&str; 3] = [
    "measured_io_stall_reduction_over_foggycache",
    "measured_unhidden_read_over_compute_saved",
    "measured_reuse_net_gain_per_step_ms",
];

/// Tasks served at once in the comparison (all arriving at 0), and the epochs each trains.
pub const TASKS: usize = 3;
/// Epochs per task in the comparison (both strategies train the same batches bit-identically).
pub const EPOCHS: u32 = 4;
/// The edge board whose storage the throttle stands for (docs/coadapt.md says why).
pub const BOARD: &str = "a Jetson Nano developer kit's UHS-I microSD card (about 90 MB/s)";
/// That board's storage read bandwidth, bytes per second: the throttle where this machine's
/// storage already reads slower than the 0.7x target (so the run still never reads faster than
/// the board).
pub const BOARD_READ_BPS: u64 = 90_000_000;

/// Median of `v` (0 for none).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// CPU microseconds of the stem per image (median of five passes over `images`).
fn stem_us_per_image(student: &VMoe, images: &troupe_kernels::Tensor, n: usize) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = real::process_cpu_us();
        student.stem(images)?;
        v.push((real::process_cpu_us() - t) as f64 / n.max(1) as f64);
    }
    Ok(median(v))
}

/// Wall microseconds of one unthrottled direct read of an `entry_bytes` entry (median of 64), from
/// a slot file in a fresh directory under `parent`.
fn unthrottled_read_us(parent: &std::path::Path, entry_bytes: usize) -> Result<f64> {
    let file = parent.join(format!("troupe-read-probe-{}.slots", std::process::id()));
    let probe = || -> Result<f64> {
        let mut f = SlotFile::create(&file, entry_bytes)?;
        let data: Vec<u8> = (0..entry_bytes).map(|i| (i * 31 % 251) as u8).collect();
        for s in 0..64 {
            f.write(s, &data)?;
        }
        let mut v = Vec::new();
        for s in 0..64 {
            let t = Instant::now();
            let back = f.read(s)?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
            anyhow::ensure!(back == data, "the read probe read back other bytes");
        }
        Ok(median(v))
    };
    let r = probe().with_context(|| format!("the read probe {}", file.display()));
    let _ = std::fs::remove_file(&file);
    r
}

/// Reuse's net gain per step, ms: compute the reused entries saved minus the stall, over steps.
fn net_gain_per_step_ms(o: &RunOutcome, saved_us: f64) -> f64 {
    (o.reuse.hits as f64 * saved_us - o.reuse.stall_us as f64) / o.steps.max(1) as f64 / 1e3
}

/// Runs the comparison on `jobs` (the first [`TASKS`]) and records its figures in `fig`; the
/// throttle is `asked` where given (`--storage-read-bps`), else picked as the module docs say.
/// Returns the throttle it set, for the sweep to run at.
pub fn run(
    name: &str,
    student: &VMoe,
    sc: &SweepConfig,
    jobs: &[Dataset],
    asked: Option<u64>,
    fig: &mut BTreeMap<String, f64>,
) -> Result<u64> {
    if let Some(b) = asked {
        check_read_bps(b).map_err(|why| anyhow::anyhow!("--storage-read-bps: {why}"))?;
        anyhow::ensure!(b > 0, "--storage-read-bps: 0 is no throttle; the comparison needs one");
    }
    let c = student.config;
    let entry_bytes = c.tokens_per_image() * c.dim * 4;
    let batch = sc.engine.batch.min(jobs[0].len());
    let idx: Vec<usize> = (0..batch).collect();
    let saved_us = stem_us_per_image(student, &jobs[0].batch(&idx)?, batch)?;
    let parent = std::env::temp_dir();
    let base_us = unthrottled_read_us(&parent, entry_bytes)?;
    let bps = read_bps_for(entry_bytes as u64, saved_us, base_us, SEED_READ_OVER_COMPUTE);
    println!(
        "\n== measured: the reuse cache at an edge board's storage bandwidth ({name}, {TASKS} tasks at once, {EPOCHS} epochs) ==\n\
         one reuse saves {saved_us:.0} us of stem compute per image; an entry ({entry_bytes} B) reads in {base_us:.0} us unthrottled; \
         throttle for an un-hidden read of {SEED_READ_OVER_COMPUTE:.2}x the compute saved: {}",
        bps.map_or(
            format!(
                "none reaches it (the storage is already slower), so the board's {:.0} MB/s",
                BOARD_READ_BPS as f64 / 1e6
            ),
            |b| format!("{:.1} MB/s", b as f64 / 1e6)
        )
    );
    let set_bps = asked.or(bps).unwrap_or(BOARD_READ_BPS);
    if let Some(b) = asked {
        println!("throttle as asked (--storage-read-bps): {:.1} MB/s", b as f64 / 1e6);
    }
    let jobs = &jobs[..TASKS.min(jobs.len())];
    let arrivals = vec![0; jobs.len()];
    let base = EngineConfig {
        max_epochs: EPOCHS,
        // Unreachable: every task trains all its epochs, so both strategies do the same work.
        target_gain: 0.99,
        storage_read_bps: set_bps,
        ..real::strategy_config(sc, student, &RealStrategy::OURS)
    };
    let started = Instant::now();
    let mut outs = Vec::new();
    let small = EngineConfig { reuse_budget: 0, ..base };
    let fog = EngineConfig { reuse_on_demand: true, ..base };
    for (label, cfg) in [("ours", base), ("ours-small", small), ("foggycache", fog)] {
        let o = real::run_once(cfg, student, jobs, &arrivals, None).with_context(|| {
            format!("the storage comparison, {label} (storage_read_bps {})", cfg.storage_read_bps)
        })?;
        let r = o.reuse;
        println!(
            "{label:<10} steps {:>4}  reuses {:>5}  computed {:>5}  read from disk {:>5}  hidden share {:.2}  I/O stall {:>8.1} ms  net gain per step {:>7.2} ms",
            o.steps,
            r.hits,
            r.misses,
            r.prefetched,
            r.prefetch_hidden_share,
            r.stall_us as f64 / 1e3,
            net_gain_per_step_ms(&o, saved_us)
        );
        outs.push(o);
    }
    let (ours, small, fog) = (&outs[0], &outs[1], &outs[2]);
    let reduction_of = |o: &RunOutcome| {
        if fog.reuse.stall_us == 0 {
            f64::NAN
        } else {
            1.0 - o.reuse.stall_us as f64 / fog.reuse.stall_us as f64
        }
    };
    let reduction = reduction_of(ours);
    let unhidden = fog.reuse.stall_us as f64 / fog.reuse.prefetched.max(1) as f64;
    println!(
        "I/O stall reduction over FoggyCache-like: {:.1}% (goal >= 80%; the seed 86.9%; ours-small, the memory tier of one batch: {:.1}%); an un-hidden read costs {:.2}x the compute it saves (target {SEED_READ_OVER_COMPUTE:.2}); storage stands for {BOARD}; {:.1} s wall",
        reduction * 100.0,
        reduction_of(small) * 100.0,
        unhidden / saved_us.max(1e-9),
        started.elapsed().as_secs_f64()
    );
    fig.insert("measured_storage_read_bps".into(), set_bps as f64);
    let reaches = asked.is_none() && bps.is_some();
    fig.insert("measured_storage_read_bps_reaches_target".into(), if reaches { 1.0 } else { 0.0 });
    fig.insert("measured_reuse_compute_saved_per_image_us".into(), saved_us);
    fig.insert("measured_unthrottled_read_us".into(), base_us);
    fig.insert("measured_unhidden_read_over_compute_saved".into(), unhidden / saved_us.max(1e-9));
    fig.insert("measured_io_stall_ms_ours".into(), ours.reuse.stall_us as f64 / 1e3);
    fig.insert("measured_io_stall_ms_foggycache".into(), fog.reuse.stall_us as f64 / 1e3);
    fig.insert("measured_io_stall_reduction_over_foggycache".into(), reduction);
    fig.insert("measured_io_stall_ms_ours_small_tier".into(), small.reuse.stall_us as f64 / 1e3);
    fig.insert("measured_io_stall_reduction_over_foggycache_small_tier".into(), reduction_of(small));
    fig.insert("measured_reuse_net_gain_per_step_ms".into(), net_gain_per_step_ms(ours, saved_us));
    fig.insert("measured_reuse_net_gain_per_step_ms_foggycache".into(), net_gain_per_step_ms(fog, saved_us));
    Ok(set_bps)
}
