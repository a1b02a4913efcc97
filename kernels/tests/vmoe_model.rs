//! The V-MoE's backward pass against finite differences on a tiny config, patchify by hand, and the
//! adaptation scope (only experts and projector move).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_kernels::Tensor;
use troupe_kernels::ops::cross_entropy;
use troupe_kernels::vmoe::{ParamGroup, TrainScope, Trainer, VMoe, VMoeConfig};

fn tiny() -> VMoeConfig {
    VMoeConfig {
        patch: 4,
        dim: 4,
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
fn patches_are_cut_row_major() {
    let cfg = VMoeConfig { patch: 2, ..tiny() };
    let m = VMoe::new(cfg, &mut SmallRng::seed_from_u64(1)).unwrap();
    let x = Tensor::from_f32(&[1, 64], (0..64).map(|i| i as f32).collect()).unwrap();
    let p = m.patchify(&x).unwrap();
    assert_eq!(p.shape(), &[16, 4]);
    let v = p.to_vec_f32();
    // Token 0 is pixels (0,0),(0,1),(1,0),(1,1); token 1 starts at column 2; token 4 at row 2.
    assert_eq!(&v[0..4], &[0.0, 1.0, 8.0, 9.0]);
    assert_eq!(&v[4..8], &[2.0, 3.0, 10.0, 11.0]);
    assert_eq!(&v[16..20], &[16.0, 17.0, 24.0, 25.0]);
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
    assert!(VMoeConfig { top_k: 4, ..tiny() }.validate().is_err());
}
