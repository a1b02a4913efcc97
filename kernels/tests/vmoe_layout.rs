//! The lifespan-ordered layout of the co-adaptation pool (`CoAdaptPool::set_ordered`, decisions in
//! `troupe_policy::adapt::layout`): the optimiser state is allocated when a model is loaded, a
//! step's temporaries are one contiguous region just below the reuse arena (or the budget's end),
//! above every long-lived buffer, a departed model's hole is closed by sliding the buffers above
//! it down (their bytes, merged parts and optimiser moments with them), and the layout can only be
//! chosen on an empty pool.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::Tensor;
use troupe_kernels::vmoe::reuse::ReuseSetup;
use troupe_kernels::vmoe::train::Dataset;
use troupe_kernels::vmoe::{CoAdaptPool, TrainScope, Trainer, VMoe, VMoeConfig};

fn model(cfg: VMoeConfig, seed: u64) -> VMoe {
    VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).expect("valid test input")
}

fn batch(n: usize) -> (Tensor, Vec<usize>) {
    let x = (0..n * 64).map(|i| ((i * 37) % 17) as f32 / 16.0).collect();
    (Tensor::from_f32(&[n, 64], x).expect("valid test input"), (0..n).map(|i| i % 10).collect())
}

/// The batch as a dataset to predict on.
fn as_dataset(x: &Tensor, y: &[usize]) -> Dataset {
    Dataset { images: x.as_f32().expect("f32 batch").to_vec(), labels: y.to_vec() }
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
    // closed at once: the buffers above it slide down, b's bytes with them.
    let data = as_dataset(&x, &y);
    let before = pool.predict(b, &data).unwrap();
    let moved_before = pool.compacted_bytes();
    pool.unload(a).unwrap();
    let s = pool.stats();
    assert_eq!((s.free_blocks, s.external_fragmentation), (1, 0.0), "no hole left below b");
    assert!(pool.compacted_bytes() > moved_before, "b's buffers moved down");
    assert_eq!(pool.predict(b, &data).unwrap(), before, "b answers as before its move");
    pool.adapt_step(b, &x, &y, 1e-3).unwrap();
    // The next model of the same shape goes on top, still merged with b.
    let c = pool.load("c", &model(cfg, 1)).unwrap();
    let s = pool.stats();
    assert_eq!((s.free_blocks, s.used), (1, long_lived + arena));
    assert!(pool.model(b).unwrap().params.patch_w.shares_buffer_with(&pool.model(c).unwrap().params.patch_w));
    pool.disable_reuse().unwrap();
}

#[test]
fn compaction_moves_the_merged_parts_and_the_optimiser_moments_and_training_goes_on_the_same() {
    // Two pools run the same steps; in one a model below b leaves (so b and the merged parts
    // move), in the other the same model is never loaded. b trains the same in both.
    let cfg = VMoeConfig::tiny();
    let (x, y) = batch(8);
    let mut moved = CoAdaptPool::new("moved", 16 << 20).unwrap();
    let mut still = CoAdaptPool::new("still", 16 << 20).unwrap();
    moved.set_ordered(true).unwrap();
    still.set_ordered(true).unwrap();
    // A model of another shape first: its own shared parts sit lowest and leave with it.
    let first = moved.load("first", &model(VMoeConfig::small(), 2)).unwrap();
    let b1 = moved.load("b", &model(cfg, 1)).unwrap();
    let b2 = still.load("b", &model(cfg, 1)).unwrap();
    moved.adapt_step(b1, &x, &y, 1e-3).unwrap();
    still.adapt_step(b2, &x, &y, 1e-3).unwrap();
    moved.unload(first).unwrap();
    assert!(moved.compacted_bytes() >= moved.stats().used, "everything b holds moved");
    assert_eq!(moved.stats().used, still.stats().used);
    for _ in 0..2 {
        let r1 = moved.adapt_step(b1, &x, &y, 1e-3).unwrap();
        let r2 = still.adapt_step(b2, &x, &y, 1e-3).unwrap();
        assert_eq!(r1.loss.to_bits(), r2.loss.to_bits(), "moments and weights survived the move");
    }
    let data = as_dataset(&x, &y);
    assert_eq!(moved.predict(b1, &data).unwrap(), still.predict(b2, &data).unwrap());
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
