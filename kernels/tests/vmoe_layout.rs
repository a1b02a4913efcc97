//! The lifespan-ordered layout of the co-adaptation pool (`CoAdaptPool::set_ordered`, decisions in
//! `troupe_policy::adapt::layout`): the optimiser state is allocated when a model is loaded, a
//! step's temporaries are one contiguous region just below the reuse arena (or the budget's end),
//! above every long-lived buffer, a departed model's hole is refilled by the next one, and the
//! layout can only be chosen on an empty pool.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::Tensor;
use troupe_kernels::vmoe::reuse::ReuseSetup;
use troupe_kernels::vmoe::{CoAdaptPool, TrainScope, Trainer, VMoe, VMoeConfig};

fn model(cfg: VMoeConfig, seed: u64) -> VMoe {
    VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).expect("valid test input")
}

fn batch(n: usize) -> (Tensor, Vec<usize>) {
    let x = (0..n * 64).map(|i| ((i * 37) % 17) as f32 / 16.0).collect();
    (Tensor::from_f32(&[n, 64], x).expect("valid test input"), (0..n).map(|i| i % 10).collect())
}

fn state_bytes(cfg: &VMoeConfig) -> u64 {
    Trainer::state_bytes(cfg, TrainScope::ExpertsAndProjector).div_ceil(256) * 256
}

#[test]
fn optimiser_state_comes_with_the_load_not_the_step() {
    let cfg = VMoeConfig::tiny();
    let (x, y) = batch(8);
    for ordered in [true, false] {
        let mut pool = CoAdaptPool::new("state", 16 << 20).unwrap();
        pool.set_ordered(ordered).unwrap();
        let id = pool.load("cam", &model(cfg, 1)).unwrap();
        let after_load = pool.stats().used;
        pool.adapt_step(id, &x, &y, 1e-3).unwrap();
        let after_step = pool.stats().used;
        if ordered {
            assert_eq!(after_step, after_load, "ordered: the step allocates nothing that outlives it");
        } else {
            assert_eq!(after_step, after_load + state_bytes(&cfg), "best fit: state on the first step");
        }
    }
}

#[test]
fn temporaries_are_one_region_below_the_reuse_arena_and_above_the_models() {
    let cfg = VMoeConfig::tiny();
    let (x, y) = batch(8);
    let tmp = tempfile::tempdir().unwrap();
    let budget = 16u64 << 20;
    let mut pool = CoAdaptPool::new("region", budget).unwrap();
    pool.set_ordered(true).unwrap();
    let arena = 64u64 << 10;
    pool.enable_reuse(&ReuseSetup::new(arena, 1 << 20, tmp.path())).unwrap();
    let a = pool.load("a", &model(cfg, 1)).unwrap();
    let b = pool.load("b", &model(cfg, 1)).unwrap();
    // Long-lived buffers are packed from 0: they end at the bytes they use (arena aside).
    let long_lived = pool.stats().used - arena;
    let r = pool.adapt_step(b, &x, &y, 1e-3).unwrap();
    let (start, end) = pool.last_region().expect("ordered steps place a region");
    assert_eq!(end, budget - arena, "the region ends where the reuse arena starts");
    assert_eq!(end - start, r.reserved_bytes, "contiguous: exactly the step's reservation");
    assert!(start >= long_lived, "above every long-lived buffer ({start} < {long_lived})");
    // After the step the free memory is one block again.
    let s = pool.stats();
    assert_eq!((s.free_blocks, s.external_fragmentation), (1, 0.0));
    // A departed model's hole (its experts, projector and state; the merged parts stay) is
    // refilled by the next model of the same shape.
    pool.unload(a).unwrap();
    assert_eq!(pool.stats().free_blocks, 2);
    pool.load("c", &model(cfg, 1)).unwrap();
    let s = pool.stats();
    assert_eq!((s.free_blocks, s.used), (1, long_lived + arena));
    pool.disable_reuse().unwrap();
}

#[test]
fn the_layout_is_chosen_on_an_empty_pool_and_refuses_what_does_not_fit() {
    let cfg = VMoeConfig::tiny();
    let mut pool = CoAdaptPool::new("late", 16 << 20).unwrap();
    pool.load("a", &model(cfg, 1)).unwrap();
    assert!(pool.set_ordered(true).is_err(), "buffers already placed would not move");
    // Room for the model and its state but not for a step: the step is refused, nothing kept.
    let mut small = CoAdaptPool::new("small", 1 << 20).unwrap();
    small.set_ordered(true).unwrap();
    let id = small.load("a", &model(cfg, 1)).unwrap();
    let used = small.stats().used;
    let (x, y) = batch(64);
    assert!(small.adapt_step(id, &x, &y, 1e-3).is_err());
    assert_eq!(small.stats().used, used);
    assert_eq!(small.last_region(), None);
}
