//! The V-MoE's backward pass against finite differences on a tiny config (attention included: every
//! parameter of every block, so input gradients through attention reach the earlier block's
//! experts), upsampling and patchify by hand, and the adaptation scope (only experts and projector
//! move; attention stays frozen).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_kernels::Tensor;
use troupe_kernels::ops::cross_entropy;
use troupe_kernels::vmoe::model::{INPUT_PIXELS, INPUT_SIDE, upsample};
use troupe_kernels::vmoe::{ParamGroup, TrainScope, Trainer, VMoe, VMoeConfig};

fn tiny() -> VMoeConfig {
    VMoeConfig {
        patch: 4,
        dim: 4,
        heads: 2,
        blocks: 2,
        experts: 3,
        top_k: 2,
        hidden: 5,
        proj: 4,
        classes: 3,
        capacity_factor: 1.0,
    }
}

fn images(seed: u64, batch: usize) -> Tensor {
    let mut rng = SmallRng::seed_from_u64(seed);
    Tensor::from_f32(&[batch, 64], (0..batch * 64).map(|_| rng.random::<f32>()).collect())
        .expect("valid test input")
}

/// Per block, the tokens each expert got: the routing decision.
fn routes(m: &VMoe, x: &Tensor) -> Vec<Vec<Vec<usize>>> {
    let (_, cache) = m.forward(x).expect("valid test input");
    cache
        .blocks
        .iter()
        .map(|b| b.routing.experts.iter().map(|a| a.iter().map(|s| s.token).collect()).collect())
        .collect()
}

fn loss(m: &VMoe, x: &Tensor, labels: &[usize]) -> f64 {
    let (logits, _) = m.forward(x).expect("valid test input");
    f64::from(cross_entropy(&logits, labels).expect("valid test input").0)
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    let mut rng = SmallRng::seed_from_u64(11);
    let mut m = VMoe::new(tiny(), &mut rng).expect("valid test input");
    // Non-trivial norms and biases so every term of the backward pass matters.
    for (_, t) in m.params.tensors_mut() {
        let v = t.f32_mut().unwrap();
        for x in v.iter_mut() {
            *x += rng.random_range(-0.3..0.3);
        }
    }
    let x = images(5, 3);
    let labels = [0, 2, 1];
    let (logits, cache) = m.forward(&x).unwrap();
    assert!(
        cache.blocks.iter().any(|b| !b.routing.dropped.is_empty()),
        "capacity 1.0 with top-2 should drop some choices"
    );
    let (_, dlogits) = cross_entropy(&logits, &labels).unwrap();
    let grads = m.backward(&cache, &dlogits).unwrap();
    let base_routes = routes(&m, &x);
    let h = 1e-3f32;
    let (mut checked, mut skipped) = (0, 0);
    let grad_list: Vec<Vec<f32>> = grads.tensors().iter().map(|(_, t)| t.to_vec_f32()).collect();
    for (ti, grad) in grad_list.iter().enumerate() {
        for (i, &g) in grad.iter().enumerate() {
            let bump = |delta: f32| {
                let mut mm = m.clone();
                let mut ts = mm.params.tensors_mut();
                ts[ti].1.f32_mut().expect("valid test input")[i] += delta;
                drop(ts);
                mm
            };
            let (plus, minus) = (bump(h), bump(-h));
            if routes(&plus, &x) != base_routes || routes(&minus, &x) != base_routes {
                skipped += 1; // the routing flipped: top-k is not differentiable there
                continue;
            }
            let numeric = (loss(&plus, &x, &labels) - loss(&minus, &x, &labels)) / (2.0 * f64::from(h));
            let analytic = f64::from(g);
            let tol = 2e-3 + 3e-2 * numeric.abs().max(analytic.abs());
            assert!(
                (numeric - analytic).abs() <= tol,
                "tensor {ti} [{i}]: numeric {numeric:.6} vs analytic {analytic:.6}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked + skipped, tiny().param_count());
    assert!(skipped * 20 < checked, "{skipped} skipped of {checked}");
}

#[test]
fn images_are_upsampled_bilinear_then_cut_row_major() {
    // One axis by hand (half-pixel centres): output i samples source (i + 0.5) / 2 - 0.5, clamped, so
    // outputs 0, 1, 2, 3 of a row (x0, x1, ...) are x0, 0.75 x0 + 0.25 x1, 0.25 x0 + 0.75 x1, ...
    let ramp: Vec<f32> = (0..64).map(|i| (i % 8) as f32 * 4.0).collect();
    let up = upsample(&ramp);
    assert_eq!(up.len(), INPUT_PIXELS);
    assert_eq!(&up[..6], &[0.0, 1.0, 3.0, 5.0, 7.0, 9.0]);
    assert_eq!(up[15], 28.0);
    assert!(up.chunks_exact(INPUT_SIDE).all(|row| row == &up[..INPUT_SIDE]), "constant down columns");
    assert!(upsample(&[0.5; 64]).iter().all(|&v| (v - 0.5).abs() < 1e-6));

    let cfg = VMoeConfig { patch: 2, ..tiny() };
    assert_eq!(cfg.tokens_per_image(), 64);
    let m = VMoe::new(cfg, &mut SmallRng::seed_from_u64(1)).unwrap();
    let img: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let x = Tensor::from_f32(&[1, 64], img.clone()).unwrap();
    let p = m.patchify(&x).unwrap();
    assert_eq!(p.shape(), &[64, 4]);
    let v = p.to_vec_f32();
    let u = upsample(&img);
    // Token 0 is grid pixels (0,0),(0,1),(1,0),(1,1); token 1 starts at column 2; token 8 at row 2.
    let at = |r: usize, c: usize| u[r * INPUT_SIDE + c];
    assert_eq!(&v[0..4], &[at(0, 0), at(0, 1), at(1, 0), at(1, 1)]);
    assert_eq!(&v[4..8], &[at(0, 2), at(0, 3), at(1, 2), at(1, 3)]);
    assert_eq!(&v[32..36], &[at(2, 0), at(2, 1), at(3, 0), at(3, 1)]);
    assert!(m.patchify(&Tensor::zeros(&[1, 63]).unwrap()).is_err());
}

#[test]
fn adaptation_scope_moves_only_experts_and_projector() {
    let mut m = VMoe::new(tiny(), &mut SmallRng::seed_from_u64(2)).unwrap();
    let before = m.clone();
    let mut t = Trainer::new(&m, TrainScope::ExpertsAndProjector, 0.01, 0.0);
    t.step(&mut m, &images(3, 4), &[0, 1, 2, 0]).unwrap();
    let mut moved_expert = false;
    for ((g, a), (_, b)) in m.params.tensors().iter().zip(before.params.tensors()) {
        let same = a.to_vec_f32() == b.to_vec_f32();
        match g {
            ParamGroup::Shared => assert!(same, "shared parameters must stay frozen"),
            ParamGroup::Projector => assert!(!same, "projector/head must train"),
            ParamGroup::Expert { .. } => moved_expert |= !same,
        }
    }
    assert!(moved_expert);
    assert!(VMoeConfig { blocks: 1, ..tiny() }.validate().is_err());
    assert!(VMoeConfig { patch: 3, ..tiny() }.validate().is_err());
    assert!(VMoeConfig { heads: 3, ..tiny() }.validate().is_err());
    assert!(VMoeConfig { heads: 0, ..tiny() }.validate().is_err());
    assert!(VMoeConfig { top_k: 4, ..tiny() }.validate().is_err());
}
