//! Co-adaptation raises accuracy against the teacher: a student merged into the pool, adapted on frames
//! its camera uploaded (labelled by the teacher; only experts and projector train), agrees with the
//! teacher more often on a held-out drifted stream of other images.

mod vmoe_common;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::index::sample;
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{CoAdaptPool, exact_match};
use vmoe_common::{split, student, teacher};

/// Stated gain in exact match against the teacher on the held-out drifted stream.
const MIN_GAIN: f64 = 0.1;

fn drifted(images: &Dataset, camera: u32, seed: u64, n: usize, schedule: &str) -> Dataset {
    let sched = DriftSchedule::parse(schedule).expect("valid test input");
    let frames: Vec<_> = CameraStream::new(camera, sched, &images.images, &images.labels, seed)
        .expect("valid test input")
        .take(n)
        .collect();
    Dataset::from_frames(&frames)
}

#[test]
fn adaptation_raises_exact_match_on_a_drifted_stream() {
    let (train, test) = split();
    let schedule = "0 rain 0.5\n150 fog 0.7\n300 snow 0.6\n";
    // Uploaded samples come from the camera's stream over training images; the held-out stream shows
    // test images under the same weather.
    let mut uploads = drifted(train, 3, 100, 450, schedule);
    let teacher = teacher();
    uploads.labels = predict_all(teacher, &uploads).unwrap();
    let held = drifted(test, 3, 200, 450, schedule);
    let held_teacher = predict_all(teacher, &held).unwrap();

    let mut pool = CoAdaptPool::new("edge", 64 << 20).unwrap();
    let id = pool.load("cam3-tiny", student()).unwrap();
    let before = exact_match(&pool.predict(id, &held).unwrap(), &held_teacher);
    let mut rng = SmallRng::seed_from_u64(5);
    let mut losses = Vec::new();
    for _ in 0..120 {
        let idx = sample(&mut rng, uploads.len(), 32).into_vec();
        let labels: Vec<usize> = idx.iter().map(|&i| uploads.labels[i]).collect();
        let r = pool
            .adapt_step(id, &uploads.batch(&idx).unwrap(), &labels, 3e-3)
            .unwrap();
        losses.push(r.loss);
    }
    let after = exact_match(&pool.predict(id, &held).unwrap(), &held_teacher);
    let head: f32 = losses[..10].iter().sum::<f32>() / 10.0;
    let tail: f32 = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    println!(
        "exact match vs teacher on held-out drift: before {before:.3} after {after:.3}; loss {head:.3} -> {tail:.3}"
    );
    assert!(tail < head, "adaptation loss should fall: {head} -> {tail}");
    assert!(
        after - before >= MIN_GAIN,
        "gain {:.3} below {MIN_GAIN}",
        after - before
    );
    // Shared parts stayed frozen: they are still the student's.
    let adapted = pool.model(id).unwrap();
    assert_eq!(
        adapted.params.patch_w.to_vec_f32(),
        student().params.patch_w.to_vec_f32()
    );
    assert_eq!(
        adapted.params.blocks[1].router.to_vec_f32(),
        student().params.blocks[1].router.to_vec_f32()
    );
}
