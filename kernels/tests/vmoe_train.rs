//! A tiny V-MoE student learns the real digits (held-out split, fixed seed), training is deterministic,
//! and a trained model survives a save/load round trip through the model zoo.

use troupe_kernels::vmoe::train::{Dataset, digits_split, predict_all, train_new};
use troupe_kernels::vmoe::{ModelZoo, Provenance, Recipe, VMoeConfig, accuracy};

/// Stated bar for the tiny student on held-out digits after the fast recipe (5 epochs).
const MIN_TEST_ACCURACY: f64 = 0.85;

fn split() -> (Dataset, Dataset) {
    digits_split().expect("digits missing: run scripts/setup")
}

#[test]
fn tiny_student_learns_digits() {
    let (train, test) = split();
    assert_eq!((train.len(), test.len()), (1438, 359));
    let (model, report) = train_new(VMoeConfig::tiny(), &train, &Recipe::fast(1)).unwrap();
    let first = report.epoch_loss[0];
    let last = *report.epoch_loss.last().unwrap();
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    let acc = accuracy(&predict_all(&model, &test).unwrap(), &test.labels);
    println!("tiny student: held-out accuracy {acc:.3}, loss {first:.3} -> {last:.3}");
    assert!(acc >= MIN_TEST_ACCURACY, "held-out accuracy {acc:.3}");
}

#[test]
fn training_is_deterministic_and_models_round_trip() {
    let (train, test) = split();
    let small = train.subset(&(0..200).collect::<Vec<_>>()).unwrap();
    assert!(train.subset(&[train.len()]).is_err());
    let recipe = Recipe { epochs: 1, ..Recipe::fast(7) };
    let (a, ra) = train_new(VMoeConfig::tiny(), &small, &recipe).unwrap();
    let (b, rb) = train_new(VMoeConfig::tiny(), &small, &recipe).unwrap();
    assert_eq!(ra, rb);
    for ((_, x), (_, y)) in a.params.tensors().iter().zip(b.params.tensors()) {
        assert_eq!(x.to_vec_f32(), y.to_vec_f32());
    }
    let other = Recipe { seed: 8, ..recipe };
    let (c, _) = train_new(VMoeConfig::tiny(), &small, &other).unwrap();
    assert_ne!(a.params.proj_w.to_vec_f32(), c.params.proj_w.to_vec_f32());

    let dir = tempfile::tempdir().unwrap();
    let zoo = ModelZoo::new(dir.path());
    let (m1, p1) = zoo.get_or_train("tiny", VMoeConfig::tiny(), &recipe, "t", &small).unwrap();
    assert!(matches!(p1, Provenance::Trained(_)));
    let (m2, p2) = zoo.get_or_train("tiny", VMoeConfig::tiny(), &recipe, "t", &small).unwrap();
    assert!(matches!(p2, Provenance::Loaded(_)));
    assert_eq!(predict_all(&m1, &test).unwrap(), predict_all(&m2, &test).unwrap());
    // A corrupted file is retrained, not trusted.
    let path = zoo.path_for("tiny", &VMoeConfig::tiny(), &recipe, "t");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let (_, p3) = zoo.get_or_train("tiny", VMoeConfig::tiny(), &recipe, "t", &small).unwrap();
    assert!(matches!(p3, Provenance::Trained(_)));
}

#[test]
fn concurrent_callers_train_a_missing_model_once() {
    let (train, _) = split();
    let small = train.subset(&(0..200).collect::<Vec<_>>()).unwrap();
    let recipe = Recipe { epochs: 1, ..Recipe::fast(9) };
    let dir = tempfile::tempdir().unwrap();
    let zoo = ModelZoo::new(dir.path());
    let provenances: Vec<Provenance> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| zoo.get_or_train("tiny", VMoeConfig::tiny(), &recipe, "t", &small).unwrap().1)
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let trained = provenances.iter().filter(|p| matches!(p, Provenance::Trained(_))).count();
    assert_eq!(trained, 1, "{provenances:?}");
}
