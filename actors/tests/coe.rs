//! The CoE workload on real ONNX experts at ci scale: outputs identical under every policy,
//! the real executor's memory accounting under random operation sequences, clear errors for a
//! corrupt expert file, a corrupt trace and a profile from other hardware.
#![cfg(feature = "onnx")]

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use troupe_actors::coe::CoeError;
use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::executor::ExpertExecutor;
use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
use troupe_actors::coe::runner::{RunOptions, run_local};
use troupe_policy::coe::{ExpertId, LatencyModel, SchedulerConfig};

mod common;
use common::{generated_app, no_baseline};

/// A fresh ci app with its profile in a temporary folder.
fn ci_app() -> (tempfile::TempDir, Arc<App>, LatencyModel) {
    let tmp = tempfile::tempdir().expect("temp dir");
    generated_app(tmp.path(), Scale::Ci, 5, &no_baseline());
    let app = App::open(tmp.path(), None).expect("opening the app");
    let p = profile(&app, &default_plan(&app)).expect("profiling");
    std::fs::write(tmp.path().join("profile.txt"), p.to_text()).expect("writing the profile");
    let profile = load_profile(&tmp.path().join("profile.txt")).expect("reading the profile");
    let latency = LatencyModel::from_profile(&profile).expect("latency model");
    (tmp, Arc::new(app), latency)
}

#[test]
fn generated_app_has_the_promised_shape() {
    let (_tmp, app, _) = ci_app();
    let m = &app.trace.model;
    assert!(m.depth() >= 2);
    assert!(m.roots().count() >= 2);
    assert_eq!(app.manifest.experts.len(), m.len());
    // Every subsequent expert's probability was assessed from real runs: a share of its
    // parent's walks, so siblings' probabilities sum to at least 1 (argmax always selects one).
    for root in m.roots() {
        let sum: f64 = root.children.iter().map(|c| m.expert(*c).unwrap().select_prob).sum();
        assert!(sum >= 1.0 - 1e-9, "children of {} sum to {sum}", root.id);
    }
    assert_eq!(app.trace.requests.len(), Scale::Ci.config().requests);
}

#[test]
fn every_policy_gives_every_request_the_same_output() {
    let (_tmp, app, latency) = ci_app();
    let mut reference: Option<Vec<u64>> = None;
    for config in SchedulerConfig::combinations() {
        let report = run_local(&app, &latency, &RunOptions::new(config)).unwrap();
        assert_eq!(report.digests.len(), app.trace.requests.len());
        assert!(report.loads >= report.belady_loads.min(1), "{}", report.label);
        for ((name, c), budget) in report.executors.iter().zip(&report.budgets) {
            // Reported by the executor itself after each load: something was held, never too much.
            assert!(c.loads == 0 || c.peak_bytes > 0, "{name}: loads but no resident bytes");
            assert!(c.peak_bytes <= *budget, "{name}: peak {} over budget {budget}", c.peak_bytes);
        }
        match &reference {
            None => reference = Some(report.digests),
            Some(r) => assert_eq!(*r, report.digests, "{} changed some request's output", report.label),
        }
    }
    // Different requests do get different outputs (the digest is not a constant).
    let r = reference.unwrap();
    assert!(r.iter().collect::<std::collections::BTreeSet<_>>().len() > 10);
}

#[test]
fn corrupt_expert_file_is_named() {
    let (tmp, app, latency) = ci_app();
    // Flip one data byte of the biggest SSD-homed expert's blob (past the 4 KiB header).
    let victim = app
        .trace
        .model
        .experts()
        .iter()
        .filter(|e| e.home == troupe_policy::coe::Tier::Ssd)
        .max_by_key(|e| e.size_bytes)
        .unwrap()
        .id;
    let path = tmp.path().join("store").join(format!("e{}.blob", victim.0));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096 + 100] ^= 0xFF;
    std::fs::write(&path, bytes).unwrap();
    let mut exec = ExpertExecutor::open(
        "cpu0",
        &app.store_dir(),
        &app.manifest,
        &app.trace.model,
        latency.expert_budget(1),
    )
    .unwrap();
    let err = exec.load(victim).unwrap_err().to_string();
    assert!(err.contains(&format!("e{}", victim.0)) && err.to_lowercase().contains("corrupt"), "{err}");
}

#[test]
fn corrupt_trace_is_named_with_its_line() {
    let (tmp, _app, _) = ci_app();
    let trace = tmp.path().join("trace.txt");
    let text = std::fs::read_to_string(&trace).unwrap();
    let bad: String = text.replacen("request 3 arrival", "request 3 arival", 1);
    let bad_path = tmp.path().join("bad-trace.txt");
    std::fs::write(&bad_path, bad).unwrap();
    let err = App::open(tmp.path(), Some(&bad_path)).unwrap_err().to_string();
    assert!(err.contains("bad-trace.txt") && err.contains("line"), "{err}");
    let missing = App::open(Path::new("/nonexistent-coe-app"), None).unwrap_err().to_string();
    assert!(missing.contains("app.txt") && missing.contains("troupe coe gen"), "{missing}");
}

#[test]
fn profile_from_other_hardware_is_refused() {
    let (tmp, _app, _) = ci_app();
    let path = tmp.path().join("profile.txt");
    let text = std::fs::read_to_string(&path).unwrap();
    let first = text.lines().nth(1).unwrap().to_string();
    assert!(first.starts_with("hardware_fingerprint "));
    std::fs::write(&path, text.replace(&first, "hardware_fingerprint Some Other Box x64 512GiB cuda"))
        .unwrap();
    let err = load_profile(&path).unwrap_err();
    assert!(matches!(err, CoeError::BadFile { .. }));
    let msg = err.to_string();
    assert!(msg.contains("profile.txt") && msg.contains("Some Other Box"), "{msg}");
}

/// One step of a random executor workload.
#[derive(Clone, Debug)]
enum Op {
    Load(u32),
    Evict(u32),
    Run(u32, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..64).prop_map(Op::Load),
        (0u32..64).prop_map(Op::Evict),
        ((0u32..64), 1usize..5).prop_map(|(e, b)| Op::Run(e, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Whatever is asked, the real executor never holds more than its budget, its byte count
    /// always equals the sessions it holds, and it refuses (rather than performs) a load past the
    /// budget, an eviction of what it does not hold and a batch of an expert not loaded.
    #[test]
    fn executor_accounting_never_exceeds_the_budget(ops in proptest::collection::vec(op(), 1..40)) {
        let shared = APP.with(std::rc::Rc::clone);
        let app = &shared.1;
        let model = &app.trace.model;
        let budget = 3 << 20;
        let mut exec = ExpertExecutor::open("cpu0", &app.store_dir(), &app.manifest, model, budget).unwrap();
        for op in ops {
            let n = model.len() as u32;
            match op {
                Op::Load(e) => {
                    let e = ExpertId(e % n);
                    let fits = exec.resident_bytes() + model.size_of(e) <= budget && !exec.is_loaded(e);
                    prop_assert_eq!(exec.load(e).is_ok(), fits);
                }
                Op::Evict(e) => {
                    let e = ExpertId(e % n);
                    let held = exec.is_loaded(e);
                    prop_assert_eq!(exec.evict(e).is_ok(), held);
                }
                Op::Run(e, b) => {
                    let e = ExpertId(e % n);
                    let held = exec.is_loaded(e);
                    let out = exec.run_batch(e, &vec![app.input(0); b]);
                    prop_assert_eq!(out.is_ok(), held);
                    if let Ok(rows) = out {
                        prop_assert_eq!(rows.len(), b);
                    }
                }
            }
            prop_assert!(exec.resident_bytes() <= budget);
            prop_assert_eq!(exec.resident_bytes(), exec.loaded_bytes());
        }
    }
}

thread_local! {
    /// One app per test thread for the property test (generation is the slow part).
    static APP: std::rc::Rc<(tempfile::TempDir, Arc<App>, LatencyModel)> = std::rc::Rc::new(ci_app());
}
