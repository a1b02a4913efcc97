//! Users' own CoE applications (`troupe coe serve --app FILE`), with the real binary and real
//! ONNX Runtime on a generated ci app:
//!
//! - the app file gen writes reads back equal to the app file of gen's own model;
//! - `serve --app` over gen's trace gives the same per-request output digests as `coe run`;
//! - `serve --app` without a trace generates its requests from the app's probabilities (the
//!   same for the same seed), profiling this machine into the work folder first;
//! - a cycle, and an edge from an output the ONNX model does not have, are refused by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use troupe_actors::coe::appfile::{AppFile, Memory};
use troupe_policy::coe::Trace;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn troupe(args: &[&str]) -> String {
    troupe_tests::run_ok(EXE.as_ref(), args).unwrap_or_else(|e| panic!("{e:#}"))
}

fn results(path: &Path) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    troupe_tests::parse_coe_results(&text).unwrap_or_else(|e| panic!("{e:#}"))
}

fn gen_app(tmp: &Path) -> PathBuf {
    let app = tmp.join("app");
    troupe_tests::coe_gen(EXE.as_ref(), &app, &["--scale", "ci", "--seed", "5", "--no-single-model"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    app
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn serve_app_gives_the_digests_of_coe_run_on_a_generated_app() {
    let tmp = tempfile::tempdir().unwrap();
    let app = gen_app(tmp.path());
    // Round trip: gen's app.toml is the app file of gen's own model (the trace's).
    let app_toml = app.join("app.toml");
    let parsed = AppFile::parse(&std::fs::read_to_string(&app_toml).unwrap(), &app_toml).unwrap();
    let trace = Trace::parse(&std::fs::read_to_string(app.join("trace.txt")).unwrap()).unwrap();
    let memory = Memory { gpu_expert_bytes: 4 << 20, cpu_expert_bytes: 6 << 20 };
    assert_eq!(parsed, AppFile::from_model(&trace.model, Some("ci"), Some(memory)));
    assert!(trace.model.depth() >= 2, "the ci app has subsequent experts");
    troupe(&["coe", "profile", "--dir", s(&app)]);
    let reference = tmp.path().join("run.txt");
    let run_log = troupe(&["coe", "run", "--dir", s(&app), "--out", s(&reference)]);
    // a summary table ends the run: the requests it answered, every one of the trace's
    let answered = troupe_tests::summary_value(&run_log, "coe run summary", "requests answered");
    assert_eq!(answered, Some(trace.requests.len().to_string()), "{run_log}");
    let served = tmp.path().join("serve.txt");
    let log = troupe(&[
        "coe",
        "serve",
        "--app",
        s(&app_toml),
        "--trace",
        s(&app.join("trace.txt")),
        "--profile",
        s(&app.join("profile.txt")),
        "--work",
        s(&tmp.path().join("work")),
        "--out",
        s(&served),
    ]);
    assert!(log.contains(&format!("{} experts", trace.model.len())), "{log}");
    let answered = troupe_tests::summary_value(&log, "coe serve summary", "requests answered");
    assert_eq!(answered, Some(trace.requests.len().to_string()), "{log}");
    let (want, got) = (results(&reference), results(&served));
    assert_eq!(want.len(), trace.requests.len());
    assert_eq!(got, want, "serve --app and coe run disagree on the outputs\n{log}");
}

#[test]
fn serve_app_generates_requests_from_the_probabilities_and_profiles() {
    let tmp = tempfile::tempdir().unwrap();
    let app = gen_app(tmp.path());
    let app_toml = app.join("app.toml");
    let serve = |seed: &str, out: &Path| {
        troupe(&["coe", "serve", "--app", s(&app_toml), "--requests", "40", "--seed", seed, "--out", s(out)])
    };
    let (a, b, c) = (tmp.path().join("a.txt"), tmp.path().join("b.txt"), tmp.path().join("c.txt"));
    let log = serve("3", &a);
    assert!(log.contains("profiled this machine"), "{log}");
    assert!(log.contains("40 requests generated (seed 3)"), "{log}");
    assert!(app.join("app.serve/profile.txt").is_file(), "the default work folder holds the profile");
    let first = results(&a);
    assert_eq!(first.iter().map(|r| r.0).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
    let log = serve("3", &b);
    assert!(!log.contains("profiled this machine"), "the written profile is reused\n{log}");
    assert_eq!(results(&b), first, "the same seed makes the same requests");
    serve("4", &c);
    assert_ne!(results(&c), first, "another seed makes other requests");
}

#[test]
fn serve_app_refuses_a_cycle_and_a_missing_output_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let app = gen_app(tmp.path());
    let write = |name: &str, body: &str| {
        let path = app.join(name);
        std::fs::write(&path, format!("format = \"troupe-coe-app 2\"\n{body}")).unwrap();
        path
    };
    let expert = |name: &str, prob: f64| {
        format!("[[expert]]\nname = \"{name}\"\nfile = \"experts/{name}.onnx\"\nprob = {prob}\n")
    };
    let cycle = write(
        "cycle.toml",
        &format!(
            "{}{}{}[[edge]]\nfrom = \"e4\"\noutput = 0\nto = \"e5\"\n[[edge]]\nfrom = \"e5\"\noutput = 0\nto = \"e4\"\n",
            expert("e0", 1.0),
            expert("e4", 0.5),
            expert("e5", 0.5)
        ),
    );
    let err =
        troupe_tests::run_ok(EXE.as_ref(), &["coe", "serve", "--app", s(&cycle)]).unwrap_err().to_string();
    assert!(
        err.contains(s(&cycle))
            && (err.contains("cycle of edges: e4 -> e5 -> e4")
                || err.contains("cycle of edges: e5 -> e4 -> e5")),
        "{err}"
    );
    // e0 is a generated preliminary with a few outputs; output 99 is not one of them.
    let wide = write(
        "wide.toml",
        &format!(
            "{}{}[[edge]]\nfrom = \"e0\"\noutput = 99\nto = \"e4\"\n",
            expert("e0", 1.0),
            expert("e4", 0.5)
        ),
    );
    let err = troupe_tests::run_ok(EXE.as_ref(), &["coe", "serve", "--app", s(&wide), "--requests", "5"])
        .unwrap_err()
        .to_string();
    assert!(err.contains(s(&wide)) && err.contains("edge `e0` -> `e4` (output 99)"), "{err}");
    assert!(err.contains("outputs"), "{err}");
}
