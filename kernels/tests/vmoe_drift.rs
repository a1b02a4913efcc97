//! Drift makes a clean-trained student disagree with the (corruption-trained) teacher: on a camera
//! stream whose weather changes, exact match against the teacher drops by a stated margin.

mod vmoe_common;

use troupe_kernels::drift::{CameraStream, Corruption, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{accuracy, exact_match};
use vmoe_common::{split, student, teacher};

/// Stated drop of student-vs-teacher exact match from the clean phase to the drifted phases.
const MIN_DROP: f64 = 0.2;

#[test]
fn drift_lowers_exact_match_against_the_teacher() {
    let test = &split().1;
    let schedule =
        DriftSchedule::parse("0 clean 0\n300 rain 0.6\n500 fog 0.7\n700 snow 0.7\n900 sun 0.5\n").unwrap();
    let frames: Vec<_> =
        CameraStream::new(0, schedule, &test.images, &test.labels, 42).unwrap().take(1100).collect();
    let (clean, drifted) = frames.split_at(300);
    assert!(clean.iter().all(|f| f.corruption == Corruption::Clean));
    assert!(drifted.iter().all(|f| f.corruption != Corruption::Clean));
    let (clean, drifted) = (Dataset::from_frames(clean), Dataset::from_frames(drifted));
    let (s, t) = (student(), teacher());
    let (sc, tc) = (predict_all(s, &clean).unwrap(), predict_all(t, &clean).unwrap());
    let (sd, td) = (predict_all(s, &drifted).unwrap(), predict_all(t, &drifted).unwrap());
    let (match_clean, match_drift) = (exact_match(&sc, &tc), exact_match(&sd, &td));
    println!(
        "exact match vs teacher: clean {match_clean:.3}, drifted {match_drift:.3}; \
         teacher accuracy clean {:.3} drifted {:.3}; student accuracy drifted {:.3}",
        accuracy(&tc, &clean.labels),
        accuracy(&td, &drifted.labels),
        accuracy(&sd, &drifted.labels)
    );
    // The teacher stays a good reference under drift (it trained on corruptions).
    assert!(accuracy(&tc, &clean.labels) >= 0.9);
    assert!(accuracy(&td, &drifted.labels) >= 0.75);
    assert!(match_clean >= 0.85, "clean exact match {match_clean:.3}");
    assert!(match_clean - match_drift >= MIN_DROP, "drop {:.3} below {MIN_DROP}", match_clean - match_drift);
}
