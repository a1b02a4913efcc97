//! Time slices on the co-adaptation pool: a slice trains exactly its chosen experts of each model
//! (the others stay bit-identical), reserves the chosen experts' temporaries plus one dense
//! workspace, and a slice that does not fit is refused before anything trains.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::Tensor;
use troupe_kernels::vmoe::pool::{SliceTask, plan_bytes, subset_step_plan};
use troupe_kernels::vmoe::{CoAdaptPool, TrainScope, Trainer, VMoe, VMoeConfig, VMoeError};

fn model(cfg: VMoeConfig, seed: u64) -> VMoe {
    VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).expect("valid test input")
}

fn batch(n: usize, salt: usize) -> (Tensor, Vec<usize>) {
    let x = (0..n * 64).map(|i| (((i + salt) * 37) % 17) as f32 / 16.0).collect();
    (Tensor::from_f32(&[n, 64], x).expect("valid test input"), (0..n).map(|i| (i + salt) % 10).collect())
}

fn expert_weights(m: &VMoe, b: usize, e: usize) -> Vec<f32> {
    let ex = &m.params.blocks[b].experts[e];
    [&ex.w1, &ex.b1, &ex.w2, &ex.b2].iter().flat_map(|t| t.to_vec_f32()).collect()
}

#[test]
fn a_slice_trains_exactly_its_chosen_experts() {
    let cfg = VMoeConfig::tiny();
    let mut pool = CoAdaptPool::new("slice", 8 << 20).unwrap();
    let a = pool.load("cam0", &model(cfg, 1)).unwrap();
    let b = pool.load("cam1", &model(cfg, 2)).unwrap();
    let before: Vec<VMoe> = [a, b].iter().map(|id| pool.model(*id).unwrap().clone()).collect();
    let (xa, ya) = batch(16, 0);
    let (xb, yb) = batch(16, 5);
    let chosen_a = [(0, 1), (1, 3)];
    let chosen_b = [(1, 0)];
    // Optimiser state first, so the slice's reservation is all that changes `used`.
    pool.ensure_trainer(a, 1e-2).unwrap();
    pool.ensure_trainer(b, 1e-2).unwrap();
    let used = pool.stats().used;
    let r = pool
        .train_slice(
            &[
                SliceTask { model: a, images: &xa, labels: &ya, experts: &chosen_a },
                SliceTask { model: b, images: &xb, labels: &yb, experts: &chosen_b },
            ],
            1e-2,
        )
        .unwrap();
    assert_eq!(pool.stats().used, used, "temporaries released after the slice");
    assert_eq!(r.models[0].trained, chosen_a.to_vec());
    assert_eq!(r.models[1].trained, chosen_b.to_vec());
    for (k, (id, chosen)) in [(a, &chosen_a[..]), (b, &chosen_b[..])].into_iter().enumerate() {
        let now = pool.model(id).unwrap();
        for blk in 0..cfg.blocks {
            for e in 0..cfg.experts {
                let same = expert_weights(now, blk, e) == expert_weights(&before[k], blk, e);
                // Top-1 routing with capacity: a chosen expert with no tokens gets a zero
                // gradient, but AdamW with zero moments leaves it as is too; the test batch
                // routes tokens to every chosen one (checked by its load).
                let routed = r.models[k].expert_loads[blk][e] > 0;
                if chosen.contains(&(blk, e)) && routed {
                    assert!(!same, "model {k} expert ({blk},{e}) was chosen and did not train");
                } else if !chosen.contains(&(blk, e)) {
                    assert!(same, "model {k} expert ({blk},{e}) is frozen and changed");
                }
            }
        }
        assert_ne!(now.params.proj_w.to_vec_f32(), before[k].params.proj_w.to_vec_f32());
    }
    // The reservation: three chosen experts' temporaries plus the larger dense workspace.
    let tmp = |n: usize| {
        let p = subset_step_plan(&cfg, 16, n);
        let dense: Vec<_> = p.iter().filter(|(w, _)| *w != "expert tmp").copied().collect();
        (plan_bytes(&p, 256) - plan_bytes(&dense, 256), plan_bytes(&dense, 256))
    };
    let (tmp_a, dense_a) = tmp(2);
    let (tmp_b, dense_b) = tmp(1);
    assert_eq!(r.reserved_bytes, tmp_a + tmp_b + dense_a.max(dense_b));
    // Only trained experts are sampled for the memory estimator.
    assert_eq!(pool.tmp_samples().len(), 3);
    // Attention is sampled as in a whole-model step: every block of every model in the slice.
    let attn = pool.attention_samples();
    assert_eq!(attn.len(), 2 * cfg.blocks);
    for (s, (id, blk)) in
        attn.iter().zip([a, b].into_iter().flat_map(|id| (0..cfg.blocks).map(move |k| (id, k))))
    {
        assert_eq!((s.model, s.block, s.images, s.tokens), (id, blk, 16, cfg.tokens_per_image()));
        assert!(s.bytes > 0);
    }
}

#[test]
fn a_slice_that_does_not_fit_is_refused_before_anything_trains() {
    let cfg = VMoeConfig::tiny();
    let m = model(cfg, 3);
    let mut probe = CoAdaptPool::new("probe", 8 << 20).unwrap();
    probe.load("cam", &m).unwrap();
    let loaded = probe.stats().used;
    let state = Trainer::state_bytes(&cfg, TrainScope::ExpertsAndProjector).div_ceil(256) * 256;
    // Room for a slice of two experts, not for all eight.
    let budget = loaded + state + plan_bytes(&subset_step_plan(&cfg, 16, 2), 256);
    let mut pool = CoAdaptPool::new("edge", budget).unwrap();
    let id = pool.load("cam", &m).unwrap();
    let (x, y) = batch(16, 0);
    let two = [(0, 0), (1, 2)];
    pool.train_slice(&[SliceTask { model: id, images: &x, labels: &y, experts: &two }], 1e-2).unwrap();
    let used = pool.stats().used;
    let snapshot = pool.model(id).unwrap().clone();
    let all: Vec<(usize, usize)> =
        (0..cfg.blocks).flat_map(|b| (0..cfg.experts).map(move |e| (b, e))).collect();
    assert!(matches!(
        pool.train_slice(&[SliceTask { model: id, images: &x, labels: &y, experts: &all }], 1e-2),
        Err(VMoeError::Kernel(_))
    ));
    assert_eq!(pool.stats().used, used);
    let now = pool.model(id).unwrap();
    assert_eq!(now.params.proj_w.to_vec_f32(), snapshot.params.proj_w.to_vec_f32());
    assert_eq!(expert_weights(now, 0, 0), expert_weights(&snapshot, 0, 0));
    assert!(pool.peak_used() <= budget);
    // Bad input is refused by name.
    assert!(matches!(
        pool.train_slice(&[SliceTask { model: id, images: &x, labels: &y, experts: &[(9, 0)] }], 1e-2),
        Err(VMoeError::Config(_))
    ));
}
