//! The co-adaptation pool: merged shared parts are stored once (one buffer), every buffer goes through
//! the memory pool, a step that does not fit is refused without exceeding the budget or changing the
//! model, per-expert temporary memory matches its formula, attention temporaries (quadratic in the
//! tokens per image) are reserved and match what the forward pass kept, and fragmentation is sampled
//! over time.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::KernelError;
use troupe_kernels::Tensor;
use troupe_kernels::ops::{attention_saved_bytes, attention_tmp_bytes};
use troupe_kernels::vmoe::pool::{expert_tmp_bytes, step_plan};
use troupe_kernels::vmoe::{CoAdaptPool, TrainScope, Trainer, VMoe, VMoeConfig, VMoeError};

fn model(cfg: VMoeConfig, seed: u64) -> VMoe {
    VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).expect("valid test input")
}

fn batch(n: usize) -> (Tensor, Vec<usize>) {
    let x = (0..n * 64).map(|i| ((i * 37) % 17) as f32 / 16.0).collect();
    (Tensor::from_f32(&[n, 64], x).expect("valid test input"), (0..n).map(|i| i % 10).collect())
}

fn align(b: u64) -> u64 {
    b.div_ceil(256) * 256
}

#[test]
fn identical_shared_parts_are_stored_once() {
    let cfg = VMoeConfig::tiny();
    let m = model(cfg, 1);
    let mut pool = CoAdaptPool::new("merge", 8 << 20).unwrap();
    let a = pool.load("cam0", &m).unwrap();
    let shared = pool.shared_memory_bytes();
    let used_one = pool.stats().used;
    let b = pool.load("cam1", &m).unwrap();
    assert_eq!(pool.shared_memory_bytes(), shared, "second copy adds no shared bytes");
    let exclusive = pool.exclusive_memory_bytes(b).unwrap();
    assert_eq!(pool.stats().used, used_one + exclusive);
    // Experts and projector: one aligned allocation each.
    let per_expert = align((cfg.expert_params() * 4) as u64);
    assert_eq!(pool.expert_memory_bytes(a, 1, 3), Some(per_expert));
    assert_eq!(pool.expert_memory_bytes(a, 2, 0), None);
    assert_eq!(
        exclusive,
        (cfg.blocks * cfg.experts) as u64 * per_expert + align((cfg.projector_params() * 4) as u64)
    );
    // The merged models read one buffer.
    let (ma, mb) = (pool.model(a).unwrap(), pool.model(b).unwrap());
    assert!(ma.params.patch_w.shares_buffer_with(&mb.params.patch_w));
    assert!(ma.params.blocks[0].router.shares_buffer_with(&mb.params.blocks[0].router));
    // A different model brings its own shared tensors (except byte-identical ones such as unit norms).
    let c = pool.load("cam2", &model(VMoeConfig::small(), 2)).unwrap();
    assert!(pool.shared_memory_bytes() > shared);
    pool.unload(a).unwrap();
    assert!(pool.shared_memory_bytes() > shared, "cam1 still uses the tiny shared parts");
    pool.unload(c).unwrap();
    assert_eq!(pool.shared_memory_bytes(), shared);
    pool.unload(b).unwrap();
    let s = pool.stats();
    assert_eq!((s.used, s.allocations, pool.shared_tensors()), (0, 0, 0));
    assert!(matches!(pool.unload(b), Err(VMoeError::UnknownModel(1))));
}

#[test]
fn the_budget_is_never_exceeded_and_refusals_change_nothing() {
    let cfg = VMoeConfig::tiny();
    let m = model(cfg, 3);
    // Budget: the model, its optimiser state and one step of 16 images, plus a little slack.
    let mut probe = CoAdaptPool::new("probe", 8 << 20).unwrap();
    probe.load("cam", &m).unwrap();
    let loaded = probe.stats().used;
    let state = align(Trainer::state_bytes(&cfg, TrainScope::ExpertsAndProjector));
    let step16: u64 = step_plan(&cfg, 16).iter().map(|(_, b)| align(*b)).sum();
    let budget = loaded + state + step16 + 1024;
    let mut pool = CoAdaptPool::new("edge", budget).unwrap();
    let id = pool.load("cam", &m).unwrap();
    let (x16, y16) = batch(16);
    let r = pool.adapt_step(id, &x16, &y16, 1e-3).unwrap();
    assert_eq!(r.reserved_bytes, step16);
    assert!(r.peak_used <= budget);
    let used = pool.stats().used;
    assert_eq!(used, loaded + state, "activations released after the step");
    // A step of 64 images needs more than is free: refused, nothing trained, nothing leaked.
    let before = pool.model(id).unwrap().params.proj_w.to_vec_f32();
    let (x64, y64) = batch(64);
    match pool.adapt_step(id, &x64, &y64, 1e-3) {
        Err(VMoeError::Kernel(KernelError::OutOfMemory { budget: b, .. })) => assert_eq!(b, budget),
        other => panic!("expected the pool to refuse, got {other:?}"),
    }
    assert_eq!(pool.stats().used, used);
    assert_eq!(pool.model(id).unwrap().params.proj_w.to_vec_f32(), before);
    // A much larger model does not fit either (the free room is one step's buffers, which attention
    // over 64 tokens makes several MB); the pool is unchanged.
    let big = VMoeConfig { experts: 48, hidden: 512, ..VMoeConfig::large() };
    assert!(pool.stats().free < (big.param_count() * 4) as u64);
    assert!(matches!(
        pool.load("cam2", &model(big, 4)),
        Err(VMoeError::Kernel(KernelError::OutOfMemory { .. }))
    ));
    assert_eq!(pool.stats().used, used);
    // Steps that fit keep working after refusals.
    for _ in 0..3 {
        pool.adapt_step(id, &x16, &y16, 1e-3).unwrap();
    }
    assert!(pool.peak_used() <= budget);
    assert!(pool.fragmentation_samples().iter().all(|s| s.used <= budget));
    assert!(pool.fragmentation_samples().iter().any(|s| s.what == "refused"));
}

#[test]
fn expert_temporaries_match_their_formula_and_capacity() {
    let cfg = VMoeConfig::base();
    let mut pool = CoAdaptPool::new("tmp", 32 << 20).unwrap();
    let id = pool.load("cam", &model(cfg, 5)).unwrap();
    let (x, y) = batch(8);
    let r = pool.adapt_step(id, &x, &y, 1e-3).unwrap();
    let cap = cfg.capacity(8 * cfg.tokens_per_image());
    let samples = pool.tmp_samples();
    assert_eq!(samples.len(), cfg.blocks * cfg.experts);
    for s in samples {
        assert!(s.tokens <= cap);
        assert_eq!(s.bytes, expert_tmp_bytes(&cfg, s.tokens), "{s:?}");
    }
    let routed: usize = r.expert_loads.iter().flatten().sum();
    assert!(routed <= cfg.blocks * cfg.top_k * 8 * cfg.tokens_per_image());
    // Linear in tokens: the M_tmp estimator's slope is bytes per token.
    let slope = expert_tmp_bytes(&cfg, 11) - expert_tmp_bytes(&cfg, 10);
    assert_eq!(slope, ((2 * cfg.dim + 2 * cfg.hidden + 1) * 8 + 8) as u64);
}

#[test]
fn fragmentation_is_sampled_over_time() {
    let mut pool = CoAdaptPool::new("frag", 8 << 20).unwrap();
    let a = pool.load("a", &model(VMoeConfig::tiny(), 6)).unwrap();
    let b = pool.load("b", &model(VMoeConfig::small(), 7)).unwrap();
    let _c = pool.load("c", &model(VMoeConfig::tiny(), 8)).unwrap();
    assert_eq!(pool.fragmentation_samples().last().unwrap().external_fragmentation, 0.0);
    pool.unload(b).unwrap();
    let last = *pool.fragmentation_samples().last().unwrap();
    assert_eq!(last.what, "unload");
    assert!(last.external_fragmentation > 0.0, "{last:?}");
    let events: Vec<u64> = pool.fragmentation_samples().iter().map(|s| s.event).collect();
    assert_eq!(events, (0..events.len() as u64).collect::<Vec<_>>());
    let (x, y) = batch(4);
    pool.adapt_step(a, &x, &y, 1e-3).unwrap();
    let whats: Vec<&str> = pool.fragmentation_samples().iter().map(|s| s.what).collect();
    assert_eq!(&whats[whats.len() - 2..], &["reserve", "release"]);
}

#[test]
fn an_unshared_pool_gives_every_model_its_own_frozen_parts() {
    let m = model(VMoeConfig::tiny(), 1);
    let mut pool = CoAdaptPool::new("isolated", 8 << 20).unwrap();
    pool.set_sharing(false);
    let a = pool.load("cam0", &m).unwrap();
    let shared = pool.shared_memory_bytes();
    let b = pool.load("cam1", &m).unwrap();
    assert_eq!(pool.shared_memory_bytes(), 2 * shared, "the second copy brings its own shared parts");
    let (ma, mb) = (pool.model(a).unwrap(), pool.model(b).unwrap());
    assert!(!ma.params.patch_w.shares_buffer_with(&mb.params.patch_w));
    pool.unload(a).unwrap();
    assert_eq!(pool.shared_memory_bytes(), shared);
    pool.unload(b).unwrap();
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn attention_temporaries_are_reserved_and_grow_with_the_square_of_the_tokens() {
    let (x, y) = batch(8);
    let mut per_image_probs = Vec::new();
    // 2x2 patches of the 16x16 grid: 64 tokens per image; 4x4 patches: 16 tokens.
    for patch in [2, 4] {
        let cfg = VMoeConfig { patch, ..VMoeConfig::tiny() };
        let n = cfg.tokens_per_image();
        let plan = step_plan(&cfg, 8);
        let attn: Vec<u64> =
            plan.iter().filter(|(what, _)| *what == "attention tmp").map(|(_, b)| *b).collect();
        assert_eq!(attn, vec![attention_tmp_bytes(8, n, cfg.dim, cfg.heads); cfg.blocks]);
        let mut pool = CoAdaptPool::new("attn", 32 << 20).unwrap();
        let id = pool.load("cam", &model(cfg, 9)).unwrap();
        let r = pool.adapt_step(id, &x, &y, 1e-3).unwrap();
        assert_eq!(r.reserved_bytes, plan.iter().map(|(_, b)| align(*b)).sum::<u64>());
        // What the forward pass kept (measured from its cache) is what the plan reserved for it.
        let saved = attention_saved_bytes(8, n, cfg.dim, cfg.heads);
        assert_eq!(r.attention_bytes, cfg.blocks as u64 * saved);
        let samples = pool.attention_samples();
        assert_eq!(samples.len(), cfg.blocks);
        assert!(samples.iter().all(|s| s.tokens == n && s.images == 8 && s.bytes > saved));
        // The probabilities: what is left of the saved bytes after the 5 linear buffers.
        per_image_probs.push((saved - (5 * 8 * n * cfg.dim * 4) as u64) / 8);
    }
    // 4x the tokens, 16x the attention probabilities.
    assert_eq!(per_image_probs[0], 16 * per_image_probs[1]);
    assert_eq!(per_image_probs[0], (VMoeConfig::tiny().heads * 64 * 64 * 4) as u64);
}
