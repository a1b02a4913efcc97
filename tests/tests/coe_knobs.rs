//! `troupe coe gen` knobs, with the real binary on a generated ci app: the app records the
//! knobs it was generated with, its profiling plan takes the recorded budgets, and its trace
//! honours the skew and the rate within a stated band on a fixed seed; a budget fraction
//! outside (0, 1] is refused by the CLI naming the flag.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use troupe_actors::coe::app::App;
use troupe_actors::coe::profiler;
use troupe_policy::coe::Tier;
use troupe_policy::coe::sweep::{roots_by_rank, zipf_shares};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

#[test]
fn knobs_round_trip_through_gen_and_the_trace_honours_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("app");
    let args = [
        "coe",
        "gen",
        "--scale",
        "ci",
        "--dir",
        dir.to_str().unwrap(),
        "--seed",
        "3",
        "--device-budget",
        "0.3",
        "--host-budget",
        "0.25",
        "--zipf",
        "1.4",
        "--rate",
        "800",
        "--experts",
        "60",
        "--no-single-model",
    ];
    troupe_tests::run_ok(EXE.as_ref(), &args).unwrap_or_else(|e| panic!("{e:#}"));
    let app = App::open(&dir, None).unwrap();
    let k = app.manifest.knobs.expect("the manifest records its knobs");
    let model = &app.trace.model;
    let total = model.total_bytes() as f64;
    // Budgets: the device budget as asked (never below the largest expert), recorded in bytes
    // and used by the profiling plan; the host tier within its budget.
    assert!(k.device_budget > 0.3 - 1e-6, "{k:?}");
    assert_eq!(k.gpu_expert_bytes, (0.3 * total) as u64, "{k:?}");
    let plan = profiler::default_plan(&app);
    assert_eq!(plan[0].expert_bytes, k.gpu_expert_bytes);
    assert_eq!(plan[1].expert_bytes, k.cpu_expert_bytes);
    let host: u64 = model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum();
    assert!(host as f64 <= 0.25 * total && (k.host_budget - host as f64 / total).abs() < 1e-9, "{k:?}");
    // Expert count: about the one asked (entry experts scaled to it).
    assert_eq!(k.experts, model.len());
    assert!(k.experts.abs_diff(60) <= 15, "{} experts", k.experts);
    // Skew: the roots' shares are exactly Zipf(1.4) by rank; the 300 requests' mix is within
    // 0.1 of it per root (about 3 sigma at 300 draws).
    assert_eq!(k.zipf, 1.4);
    let ranked = roots_by_rank(model);
    let shares = zipf_shares(ranked.len(), 1.4);
    let n = app.trace.requests.len() as f64;
    for (root, share) in ranked.iter().zip(&shares) {
        assert!((model.expert(*root).unwrap().select_prob - share).abs() < 1e-9);
        let got = app.trace.requests.iter().filter(|r| r.root == *root).count() as f64 / n;
        assert!((got - share).abs() < 0.1, "{root}: {got} vs {share}");
    }
    // Rate: recorded as asked; the trace's mean rate within 30% of it (about 115 bursty
    // arrival events: one sigma is about 10%).
    assert!((k.rate_rps / 800.0 - 1.0).abs() < 1e-3, "{k:?}");
    let span = app.trace.requests.last().unwrap().arrival.0 as f64 / 1e6;
    let rate = n / span;
    assert!((rate / 800.0 - 1.0).abs() < 0.3, "trace rate {rate}");
}

#[test]
fn a_budget_fraction_outside_zero_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("app");
    for (flag, bad) in [("--device-budget", "0"), ("--host-budget", "1.5")] {
        let out = std::process::Command::new(EXE)
            .args(["coe", "gen", "--dir", dir.to_str().unwrap(), flag, bad])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && err.contains("(0, 1]"), "{err}");
    }
    assert!(!dir.exists(), "nothing generated on a refusal");
}
