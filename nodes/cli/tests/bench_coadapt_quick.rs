//! `troupe bench coadapt --quick` runs to the end as a real process and writes every headline key
//! (from real execution), the `sim_` figures apart and no unprefixed simulator headline, and an SVG
//! with the measured panel next to the simulated one. No speed is asserted: the figures' values
//! are whatever this machine measured (a ratio may be null when its denominator is zero).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn quick_coadapt_bench_writes_every_headline_key() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("coadapt.json");
    let svg = dir.path().join("coadapt.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["bench", "coadapt", "--quick", "--k-max", "4", "--ks", "1,2", "--json"])
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let figures: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in troupe_bench::coadapt::headline_keys() {
        assert!(figures.contains_key(&key), "{key} missing from {:?}", figures.keys().collect::<Vec<_>>());
    }
    for n in troupe::actors::coadapt::engine::Mechanisms::NAMES {
        assert!(figures.contains_key(&format!("measured_ablation_max_concurrency_{n}")), "{n}");
    }
    // Numbers where they must be numbers: counts of K are never null.
    for key in ["measured_max_concurrency_ours", "measured_max_concurrency_best_baseline"] {
        assert!(figures[key].is_number(), "{key}: {:?}", figures[key]);
    }
    // Nothing the simulator produced stands as an unprefixed headline.
    for old in ["max_concurrency_ours", "slo_attainment_over_best_baseline", "throughput_over_best_baseline"]
    {
        assert!(!figures.contains_key(old), "{old} is unprefixed");
    }
    assert!(figures.keys().any(|k| k.starts_with("sim_")));
    assert!(stdout.contains("ranking by pooled SLO attainment"), "{stdout}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("measured") && svg.contains("sim_"), "{svg}");
    assert!(svg.matches("<polyline").count() >= 2 * 5, "one curve per strategy in each panel");
}
