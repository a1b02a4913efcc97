//! Golden (datadriven) tests of each mechanism: inputs and expected decisions live in
//! `testdata/adapt/*.txt`; each test also asserts a few hand-checked numbers directly.

use std::fmt::Write as _;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::age::{AgeModel, fit_curve};
use super::golden::{Case, kv, run};
use super::grouping::{GroupingConfig, GroupingItem, group_experts};
use super::memory::{ExpertShape, MemoryModel, MemorySample};
use super::reuse::{
    ExpertBatch, OutputCandidate, ReuseAction, ReuseCache, ReuseConfig, TokenKey, TokenRequest,
};
use super::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec};
use super::threads::{ExpertProfile, fill_clamp_refill, uniform_split};
use super::twin::{TwinBufferScheduler, TwinConfig};
use super::{ExpertId, ModelId, TaskId};
use crate::Micros;

fn nums(line: &str) -> Vec<f64> {
    line.split_whitespace()
        .skip(1)
        .map(|w| w.parse().unwrap_or_else(|_| panic!("bad number {w:?} in {line:?}")))
        .collect()
}

fn ids(list: &str) -> Vec<u32> {
    list.split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap()).collect()
}

fn grouping_case(c: &Case) -> String {
    assert_eq!(c.cmd, "group", "unknown command");
    let items: Vec<GroupingItem> = c
        .input
        .iter()
        .map(|l| {
            let n = nums(l);
            GroupingItem {
                expert: ExpertId(n[0] as u32),
                temp_bytes: n[1] as u64,
                lifespan: Micros::from_millis(n[2] as u64),
            }
        })
        .collect();
    let cfg = GroupingConfig {
        device_budget: c.arg("budget", 0),
        static_bytes: c.arg("static", 0),
        eta_per_sec: c.arg("eta", 0.0),
        max_dp_cells: c.arg("cells", 4096),
        max_slice_experts: c.arg("max_len", usize::MAX),
    };
    let mut rng = SmallRng::seed_from_u64(c.arg("seed", 1));
    let mut out = String::new();
    match group_experts(&items, &cfg, &mut rng) {
        Ok(g) => {
            for (i, s) in g.slices.iter().enumerate() {
                let mut e: Vec<u32> = s.experts.iter().map(|e| e.0).collect();
                e.sort_unstable();
                let e: Vec<String> = e.iter().map(u32::to_string).collect();
                let _ = writeln!(
                    out,
                    "slice {i} makespan_ms={} bytes={} experts={}",
                    s.makespan.as_millis(),
                    s.temp_bytes,
                    e.join(",")
                );
            }
            let _ = writeln!(
                out,
                "fallback={} total_latency_ms={}",
                g.fallback_experts,
                g.total_latency().as_millis()
            );
        }
        Err(e) => {
            let _ = writeln!(out, "error: {e}");
        }
    }
    out
}

#[test]
fn golden_grouping() {
    run("grouping.txt", grouping_case);
    // Hand-solved instances (reasoning in the file's comments).
    let g = golden_text("grouping.txt");
    assert!(g.contains(
        "slice 0 makespan_ms=1000 bytes=80 experts=0,2\n\
         slice 1 makespan_ms=4000 bytes=60 experts=1,3\n\
         fallback=0 total_latency_ms=5000"
    ));
    assert!(g.contains("fallback=0 total_latency_ms=20000"));
    assert!(g.contains("fallback=2 total_latency_ms=11000"));
}

fn threads_case(c: &Case) -> String {
    assert_eq!(c.cmd, "fcr", "unknown command");
    let ps: Vec<ExpertProfile> = c
        .input
        .iter()
        .map(|l| {
            let n = nums(l);
            ExpertProfile {
                expert: ExpertId(n[0] as u32),
                tokens: n[1] as u64,
                per_token_us: n[2],
                min_threads: n[3] as u32,
                saturation: n[4] as u32,
            }
        })
        .collect();
    let total = c.arg("total", 0u32);
    let fmt =
        |t: &[(ExpertId, u32)]| t.iter().map(|(e, n)| format!("{}={n}", e.0)).collect::<Vec<_>>().join(" ");
    let mut out = String::new();
    match fill_clamp_refill(&ps, total) {
        Ok(a) => {
            let _ = writeln!(
                out,
                "fcr {} idle={} makespan_us={:.1}",
                fmt(&a.threads),
                a.idle,
                a.makespan_us(&ps)
            );
        }
        Err(e) => {
            let _ = writeln!(out, "fcr error: {e}");
        }
    }
    let u = uniform_split(&ps, total);
    let _ = writeln!(out, "uniform {} makespan_us={:.1}", fmt(&u.threads), u.makespan_us(&ps));
    out
}

#[test]
fn golden_threads() {
    run("threads.txt", threads_case);
    let t = golden_text("threads.txt");
    assert!(t.contains("fcr 0=4 1=4 2=8 idle=0 makespan_us=75.0"));
    assert!(t.contains("fcr 0=2 1=3 idle=5 makespan_us=5.0"));
    assert!(t.contains("fcr 0=2 1=6 idle=0 makespan_us=116.7\nuniform 0=4 1=4 makespan_us=175.0"));
}

fn memory_case(c: &Case) -> String {
    assert_eq!(c.cmd, "fit", "unknown command");
    let precision = c.arg("precision", 4.0);
    let mut samples = Vec::new();
    let mut queries = Vec::new();
    for l in &c.input {
        let n = nums(l);
        let shape = ExpertShape { tokens: n[0] as u64, d_k: n[1] as u64 };
        if l.starts_with("s ") {
            samples.push(MemorySample { shape, measured_bytes: n[2] });
        } else {
            queries.push(shape);
        }
    }
    let mut out = String::new();
    match MemoryModel::fit(precision, &samples) {
        Ok(m) => {
            let _ = writeln!(out, "theta1={:.6} theta2={:.6} m_f={:.1}", m.theta1, m.theta2, m.fixed_bytes);
            for q in queries {
                let _ = writeln!(out, "M_tmp(T={}, d_k={}) = {}", q.tokens, q.d_k, m.temporary_bytes(q));
            }
        }
        Err(e) => {
            let _ = writeln!(out, "error: {e}");
        }
    }
    out
}

#[test]
fn golden_memory() {
    run("memory.txt", memory_case);
    let text = golden_text("memory.txt");
    assert!(text.contains("theta1=3.000000 theta2=1.500000 m_f=65536.0"));
    assert!(text.contains("M_tmp(T=1000, d_k=64) = 3449536"));
    // Hand check (see memory.txt): 2 (3*1000*64 + 1.5*1000^2) + 65536 = 3449536.
    let m = MemoryModel { precision_bytes: 2.0, theta1: 3.0, theta2: 1.5, fixed_bytes: 65_536.0 };
    assert_eq!(m.temporary_bytes(ExpertShape { tokens: 1000, d_k: 64 }), 3_449_536);
}

fn age_case(c: &Case) -> String {
    assert_eq!(c.cmd, "age", "unknown command");
    let rates: Vec<f64> = c
        .args
        .get("rates")
        .map(|r| r.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or_else(|| super::age::DEFAULT_RATES.to_vec());
    let pts: Vec<(f64, f64)> = c
        .input
        .iter()
        .map(|l| {
            let n = nums(l);
            (n[0], n[1])
        })
        .collect();
    let mut out = String::new();
    let curve = fit_curve(&pts, &rates).unwrap();
    let terms: Vec<String> = curve.terms.iter().map(|(c, b)| format!("{c}:{b:.6}")).collect();
    let _ = writeln!(out, "asymptote={:.6} terms={}", curve.asymptote, terms.join(","));
    let last = pts.last().map_or(0.0, |p| p.0);
    let _ = writeln!(out, "age_next={:.6}", curve.gain_per_epoch(last));
    if let Some(t) = c.args.get("target") {
        let t: f64 = t.parse().unwrap();
        let _ = writeln!(out, "epochs_to({t})={:?}", curve.epochs_to_reach(0.0, t, 100));
    }
    // Online errors: the relative error of each one-step-ahead prediction.
    let mut m = AgeModel::new(&rates);
    let errs: Vec<String> =
        pts.iter().filter_map(|&(e, a)| m.observe(e, a)).map(|e| format!("{e:.3}")).collect();
    let _ = writeln!(out, "online_errors={}", errs.join(","));
    out
}

#[test]
fn golden_age_nnls() {
    run("age.txt", age_case);
    let a = golden_text("age.txt");
    assert!(a.contains("asymptote=0.800000 terms=0.2:0.500000\nage_next=0.008222\nepochs_to(0.75)=Some(12)"));
    assert!(a.contains("asymptote=0.900000 terms=0.1:0.300000,0.8:0.200000"));
    // A decreasing series collapses to its mean (0.552) with no exponential terms.
    assert!(a.contains("asymptote=0.552000 terms=\n"));
}

fn key_str(k: &TokenKey) -> String {
    format!("{}/{}", k.expert.0, k.sig)
}

fn reuse_case(c: &Case) -> String {
    assert_eq!(c.cmd, "reuse", "unknown command");
    let bytes = c.arg("bytes", 10u64);
    let mut cache = ReuseCache::new(ReuseConfig {
        dram_budget: c.arg("dram", 0),
        disk_budget: c.arg("disk", 0),
        lambda: c.arg("lambda", super::reuse::DEFAULT_LAMBDA),
        idle_after: Micros::from_secs(c.arg("idle_s", 10)),
        disk_idle_after: Micros::from_secs(c.arg("disk_idle_s", 100)),
    });
    let mut out = String::new();
    for line in &c.input {
        let words: Vec<&str> = line.split_whitespace().collect();
        let t: u64 = words[1].trim_start_matches("t=").parse().unwrap();
        let now = Micros::from_secs(t);
        match words[0] {
            "start" => {
                // e.g. `start t=0 0:1,2 1:5` = expert 0 gets tokens 1 and 2, expert 1 token 5.
                let batches: Vec<ExpertBatch> = words[2..]
                    .iter()
                    .map(|w| {
                        let (e, sigs) = w.split_once(':').unwrap();
                        ExpertBatch {
                            expert: ExpertId(e.parse().unwrap()),
                            tokens: ids(sigs)
                                .into_iter()
                                .map(|s| TokenRequest { sig: s as u64, bytes })
                                .collect(),
                        }
                    })
                    .collect();
                let plan = cache.handle_batch_start(now, &batches);
                let _ = writeln!(
                    out,
                    "t={t} plan computed={} reused={} prefetched_bytes={}",
                    plan.computed, plan.reused, plan.prefetched_bytes
                );
            }
            "done" => {
                // e.g. `done t=1 0:1:0.9` = output of expert 0 on token 1 with P_reuse 0.9.
                let cands: Vec<OutputCandidate> = words[2..]
                    .iter()
                    .map(|w| {
                        let p: Vec<&str> = w.split(':').collect();
                        OutputCandidate {
                            key: TokenKey {
                                expert: ExpertId(p[0].parse().unwrap()),
                                sig: p[1].parse().unwrap(),
                            },
                            bytes,
                            p_reuse: p[2].parse().unwrap(),
                            sharers: Vec::new(),
                        }
                    })
                    .collect();
                cache.handle_batch_done(now, &cands);
            }
            "tick" => cache.handle_timeout(now),
            other => panic!("unknown reuse step {other}"),
        }
        while let Some(a) = cache.poll_action() {
            let s = match a {
                ReuseAction::Prefetch { key, offset, .. } => {
                    format!("Prefetch {} -> dram@{offset}", key_str(&key))
                }
                ReuseAction::Compute { key } => format!("Compute {}", key_str(&key)),
                ReuseAction::Reuse { key } => format!("Reuse {}", key_str(&key)),
                ReuseAction::Store { key, at, .. } => format!("Store {} {at:?}", key_str(&key)),
                ReuseAction::Relocate { key, offset } => {
                    format!("Relocate {} -> dram@{offset}", key_str(&key))
                }
                ReuseAction::Evict { key, tier } => format!("Evict {} {tier:?}", key_str(&key)),
            };
            let _ = writeln!(out, "t={t} {s}");
        }
        let layout: Vec<String> =
            cache.dram_layout().iter().map(|(k, off, _)| format!("{}@{off}", key_str(k))).collect();
        let _ = writeln!(
            out,
            "t={t} state dram={} disk={} layout=[{}]",
            cache.dram_used(),
            cache.disk_used(),
            layout.join(" ")
        );
    }
    out
}

#[test]
fn golden_reuse() {
    run("reuse.txt", reuse_case);
    let r = golden_text("reuse.txt");
    assert!(r.contains("t=1 state dram=20 disk=0 layout=[0/1@0 0/2@10]"), "free room keeps I = 0");
    assert!(r.contains("t=13 plan computed=1 reused=2 prefetched_bytes=20"));
    assert!(r.contains("t=14 Relocate 0/2 -> dram@0\nt=14 Store 0/3 Dram { offset: 10 }"));
    assert!(r.contains("t=1 state dram=20 disk=10 layout=[1/2@0 0/1@10]"));
    // A prefetched entry keeps its disk copy, so demoting it writes nothing.
    assert!(r.contains("t=14 Evict 0/1 Dram\nt=14 Relocate 0/2 -> dram@0"));
    assert!(r.contains("t=30 Evict 0/2 Dram\nt=30 Evict 0/3 Dram\nt=30 Store 0/3 Disk"));
}

fn twin_case(c: &Case) -> String {
    assert_eq!(c.cmd, "twin", "unknown command");
    let mut s = TwinBufferScheduler::new(TwinConfig {
        limits: CycleLimits { memory_budget: c.arg("budget", 10), max_epochs: c.arg("max_epochs", 40) },
        alpha: c.arg("alpha", 0.45),
        delta: c.arg("delta", 0.005),
        tau: Micros::from_secs(c.arg("tau_s", 60)),
        age_error_threshold: c.arg("err", 0.5),
        error_smoothing: 0.3,
        preload_lead: Micros::from_secs(c.arg("lead_s", 2)),
        seats: c.arg("seats", 4),
        side_by_side: c.arg("side_by_side", true),
    });
    let mut out = String::new();
    for line in &c.input {
        let words: Vec<&str> = line.split_whitespace().collect();
        let a = kv(&words[1..]);
        let t: u64 = a["t"].parse().unwrap();
        let now = Micros::from_secs(t);
        match words[0] {
            "arrive" => s.handle_arrival(
                now,
                TaskSpec {
                    id: TaskId(a["id"].parse().unwrap()),
                    model: ModelId(0),
                    experts: ids(&a["experts"]).into_iter().map(ExpertId).collect(),
                    accuracy: a["acc"].parse().unwrap(),
                    target: a["target"].parse().unwrap(),
                    footprint: a["fp"].parse().unwrap(),
                    deadline: None,
                },
            ),
            "done" => s.handle_epoch_done(now, TaskId(a["id"].parse().unwrap()), a["acc"].parse().unwrap()),
            "timeout" => s.handle_timeout(now),
            other => panic!("unknown twin step {other}"),
        }
        while let Some(act) = s.poll_action() {
            let line = match act {
                SchedAction::RunEpoch { task } => format!("RunEpoch {}", task.0),
                SchedAction::Preload { task, load, unload } => format!(
                    "Preload {} load={:?} unload={:?}",
                    task.0,
                    load.iter().map(|e| e.0).collect::<Vec<_>>(),
                    unload.iter().map(|e| e.0).collect::<Vec<_>>()
                ),
                SchedAction::Complete { task, reached } => {
                    format!("Complete {} reached={reached}", task.0)
                }
            };
            let _ = writeln!(out, "t={t} {line}");
        }
        let order: Vec<String> = s
            .service_order()
            .iter()
            .map(|id| {
                let b = match s.buffer_of(*id) {
                    Some(super::twin::Buffer::Alpha) => "a",
                    _ => "b",
                };
                format!("{}{b}", id.0)
            })
            .collect();
        let _ = writeln!(
            out,
            "t={t} order=[{}] fallback={} timeout={:?}",
            order.join(" "),
            s.in_fallback(),
            s.poll_timeout().map(|m| m.as_millis())
        );
    }
    out
}

#[test]
fn golden_twin() {
    run("twin.txt", twin_case);
    let tw = golden_text("twin.txt");
    assert!(tw.contains("t=0 RunEpoch 1\nt=0 order=[1a] "));
    assert!(tw.contains("t=18 Preload 3 load=[30, 31] unload=[]"));
    assert!(tw.contains("t=20 Complete 2 reached=true"));
    assert!(tw.contains("t=40 Complete 1 reached=true"));
}

/// The text of a golden file (read after `run`, so an update run checks what it wrote).
fn golden_text(name: &str) -> String {
    std::fs::read_to_string(
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/adapt").join(name),
    )
    .unwrap()
}
