//! The generated CoE app's experts are trained: at a fixed seed the CoE (coarse-group
//! preliminaries routing to specialised leaves) is more accurate on the held-out split than a
//! single MLP of the same total bytes trained the same way, both run with ONNX Runtime.

use troupe_actors::coe::accuracy::Accuracy;
use troupe_actors::coe::app::{App, Scale, generate};

#[test]
fn trained_coe_beats_a_single_model_of_the_same_bytes() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let report =
        generate(tmp.path(), Scale::Ci, 3).expect("generating the ci app (needs scripts/setup's digits)");
    let a = report.accuracy;
    eprintln!("coe gen ci seed 3: {a:?}, {:.1}s", report.seconds);
    assert_eq!(Accuracy::read(tmp.path()).expect("reading accuracy.txt"), a, "the file records the report");
    // Same bytes, as near as the baseline's widths allow.
    let gap = (a.single_model_bytes as f64 / a.expert_bytes as f64 - 1.0).abs();
    assert!(gap < 0.01, "single model {} bytes vs experts {}", a.single_model_bytes, a.expert_bytes);
    // Both learned something: far above the 10% of guessing.
    assert!(a.single_model_accuracy > 0.8, "{a:?}");
    assert!(
        a.coe_accuracy > a.single_model_accuracy,
        "CoE {} vs single model {}",
        a.coe_accuracy,
        a.single_model_accuracy
    );
    // The trace's images are held out: none was trained on or calibrated with.
    let app = App::open(tmp.path(), None).expect("opening the app");
    let split = troupe_actors::coe::train::split(app.digits.len(), 3);
    assert!(app.trace.requests.iter().all(|r| split.test.contains(&(r.input as usize))));
}
