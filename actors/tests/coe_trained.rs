//! The generated CoE app's experts are trained: at a fixed seed the CoE (coarse-group
//! preliminaries routing to specialised leaves) and a single MLP of the same total bytes,
//! trained the same way, both classify the held-out split far above chance when run with ONNX
//! Runtime; the record on disk matches the report, and the trace's images are held out.
//!
//! At this seed (the test's since before the experts were grouped by class affinity) the CoE
//! answers more test images right than the same-bytes single model, trained on as many samples
//! per model. Over seeds 1-8 it wins five and loses three (see the README's coe section), so
//! another seed may fail this.
#![cfg(feature = "onnx")]

use troupe_actors::coe::accuracy::Accuracy;
use troupe_actors::coe::app::{App, Scale, generate};
use troupe_actors::coe::train::split;

#[test]
fn trained_coe_answers_held_out_images_better_than_the_same_bytes_single_model_at_seed_3() {
    let tmp = tempfile::tempdir().expect("temp dir");
    // A profile left from an earlier app in the folder is stale once the app is regenerated.
    std::fs::write(tmp.path().join("profile.txt"), "stale").expect("writing a stale profile");
    let report =
        generate(tmp.path(), Scale::Ci, 3).expect("generating the ci app (needs scripts/setup's digits)");
    let a = report.accuracy;
    eprintln!("coe gen ci seed 3: {a:?}, {:.1}s", report.seconds);
    assert_eq!(Accuracy::read(tmp.path()).expect("reading accuracy.txt"), a, "the file records the report");
    assert!(!tmp.path().join("profile.txt").exists(), "the old app's profile was kept");
    // Same bytes, as near as the baseline's widths allow.
    let gap = (a.single_model_bytes as f64 / a.expert_bytes as f64 - 1.0).abs();
    assert!(gap < 0.01, "single model {} bytes vs experts {}", a.single_model_bytes, a.expert_bytes);
    // Both learned: random-initialised experts score about 10% (guessing).
    assert!(a.coe_accuracy > 0.9 && a.single_model_accuracy > 0.9, "{a:?}");
    // The CoE above the single model of the same bytes.
    assert!(a.coe_accuracy > a.single_model_accuracy, "{a:?}");
    // Routing is measured: most walks reach their digit's group, and those are answered well.
    assert!(a.routed_share > 0.9 && a.routed_share < 1.0 + 1e-12, "{a:?}");
    assert!(a.accuracy_when_routed > 0.9 && a.accuracy_when_routed < 1.0 + 1e-12, "{a:?}");
    // The trace's images are held out: none was trained on or calibrated with.
    let app = App::open(tmp.path(), None).expect("opening the app");
    let s = split(app.digits.len(), 3);
    assert_eq!(a.test_images, s.test.len());
    assert!(app.trace.requests.iter().all(|r| s.test.contains(&(r.input as usize))));
}
