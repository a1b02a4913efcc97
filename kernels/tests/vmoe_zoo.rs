//! Trains (or loads) the four students and the teacher with the full recipe into
//! `.cache/models/vmoe/` and prints their accuracies, training times and sizes. Run in release:
//! `cargo test --release -p troupe-kernels --test vmoe_zoo -- --ignored --nocapture`.

use std::time::Instant;

use troupe_kernels::vmoe::pool::expert_tmp_bytes;
use troupe_kernels::vmoe::train::{digits_split, predict_all, teacher_data};
use troupe_kernels::vmoe::{CoAdaptPool, ModelZoo, Provenance, Recipe, VMoeConfig, accuracy, exact_match};

#[test]
#[ignore = "trains every size; run in release with --ignored"]
fn zoo_trains_every_size() {
    let (train, test) = digits_split().expect("run scripts/setup first");
    let zoo = ModelZoo::in_cache().unwrap();
    let recipe = Recipe::full(1);
    let t0 = Instant::now();
    let tdata = teacher_data(&train, recipe.seed);
    let (teacher, prov) =
        zoo.get_or_train("teacher", VMoeConfig::teacher(), &recipe, "digits+corrupted", &tdata).unwrap();
    let tpred = predict_all(&teacher, &test).unwrap();
    let corrupted = test.corrupted(1, 0.3, 99);
    let tpred_c = predict_all(&teacher, &corrupted).unwrap();
    println!(
        "teacher: params {} test acc {:.3} corrupted acc {:.3} ({:.1}s, {})",
        VMoeConfig::teacher().param_count(),
        accuracy(&tpred, &test.labels),
        accuracy(&tpred_c, &corrupted.labels),
        t0.elapsed().as_secs_f64(),
        matches!(prov, Provenance::Trained(_))
    );
    let mut pool = CoAdaptPool::new("report", 256 << 20).unwrap();
    for name in VMoeConfig::STUDENT_SIZES {
        let cfg = VMoeConfig::named(name).unwrap();
        let t0 = Instant::now();
        let (m, prov) = zoo.get_or_train(name, cfg, &recipe, "digits", &train).unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let p = predict_all(&m, &test).unwrap();
        let pc = predict_all(&m, &corrupted).unwrap();
        println!(
            "{name}: params {} test acc {:.3} match-vs-teacher clean {:.3} corrupted {:.3} ({secs:.1}s, trained {})",
            cfg.param_count(),
            accuracy(&p, &test.labels),
            exact_match(&p, &tpred),
            exact_match(&pc, &tpred_c),
            matches!(prov, Provenance::Trained(_))
        );
        let id = pool.load(name, &m).unwrap();
        println!(
            "  memory: exclusive {} B (experts + projector), expert {} B, tmp per expert for 64 tokens {} B",
            pool.exclusive_memory_bytes(id).unwrap(),
            pool.expert_memory_bytes(id, 0, 0).unwrap(),
            expert_tmp_bytes(&cfg, 64)
        );
    }
    println!(
        "pool with all four students: used {} B, shared {} B",
        pool.stats().used,
        pool.shared_memory_bytes()
    );
}
