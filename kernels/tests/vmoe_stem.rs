//! The cached-stem path ([`VMoe::forward_from_stem`]) against the full forward and backward: stem
//! tokens computed one image at a time, reassembled into a batch, give bit-identical logits, routing
//! and gradients for everything after the stem (experts, routers, norms, projector, head), and zero
//! gradients for the stem's frozen parameters.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_kernels::Tensor;
use troupe_kernels::ops::cross_entropy;
use troupe_kernels::vmoe::{VMoe, VMoeConfig};

fn images(seed: u64, batch: usize) -> Tensor {
    let mut rng = SmallRng::seed_from_u64(seed);
    Tensor::from_f32(&[batch, 64], (0..batch * 64).map(|_| rng.random::<f32>()).collect()).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.f32_cow().iter().map(|v| v.to_bits()).collect()
}

/// Stem tokens of each image computed alone, then concatenated in batch order.
fn per_image_stem(m: &VMoe, x: &Tensor) -> Tensor {
    let (batch, px) = x.dims2().unwrap();
    let xv = x.f32_cow();
    let mut rows = Vec::new();
    for i in 0..batch {
        let one = Tensor::from_f32(&[1, px], xv[i * px..(i + 1) * px].to_vec()).unwrap();
        rows.extend(m.stem(&one).unwrap().f32_cow().iter().copied());
    }
    Tensor::from_f32(&[batch * m.config.tokens_per_image(), m.config.dim], rows).unwrap()
}

fn check(config: VMoeConfig, seed: u64) {
    let m = VMoe::new(config, &mut SmallRng::seed_from_u64(seed)).unwrap();
    let x = images(seed + 1, 12);
    let labels: Vec<usize> = (0..12).map(|i| i % config.classes).collect();
    let (logits, cache) = m.forward(&x).unwrap();
    let stem = per_image_stem(&m, &x);
    let (logits_s, cache_s) = m.forward_from_stem(&stem).unwrap();
    assert!(cache_s.from_stem && !cache.from_stem);
    assert_eq!(bits(&logits), bits(&logits_s), "logits differ");
    for b in 0..config.blocks {
        assert_eq!(cache.expert_load(b), cache_s.expert_load(b), "routing of block {b}");
    }
    let (_, dlogits) = cross_entropy(&logits, &labels).unwrap();
    let full = m.backward(&cache, &dlogits).unwrap();
    let fast = m.backward(&cache_s, &dlogits).unwrap();
    let (ft, st) = (full.tensors(), fast.tensors());
    assert_eq!(ft.len(), st.len());
    // Tensor order: patch_w, patch_b, pos, then per block 6 attention tensors, 3 MoE-norm/router
    // tensors and 4 per expert; the stem is the first 3 + block 0's first 6.
    let stem_tensors = 3 + 6;
    let mut nonzero_stem = 0;
    for (i, ((g, a), (_, b))) in ft.iter().zip(&st).enumerate() {
        assert_eq!(a.shape(), b.shape(), "tensor {i}");
        if i < stem_tensors {
            assert!(b.f32_cow().iter().all(|&v| v == 0.0), "stem grad {i} not zero");
            nonzero_stem += usize::from(a.f32_cow().iter().any(|&v| v != 0.0));
        } else {
            assert_eq!(bits(a), bits(b), "gradient of tensor {i} ({g:?}) differs");
        }
    }
    // The full path did compute stem gradients, so the zeros above are a real difference.
    assert!(nonzero_stem > 0);
}

#[test]
fn cached_stem_is_bit_identical_tiny_student() {
    check(VMoeConfig::tiny(), 3);
}

#[test]
fn cached_stem_is_bit_identical_small_student() {
    check(VMoeConfig::small(), 9);
}

#[test]
fn stem_tokens_of_an_image_do_not_depend_on_its_batch() {
    let m = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(5)).unwrap();
    let x = images(6, 7);
    assert_eq!(bits(&m.stem(&x).unwrap()), bits(&per_image_stem(&m, &x)));
}

#[test]
fn forward_from_stem_rejects_bad_shapes() {
    let m = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(5)).unwrap();
    let d = m.config.dim;
    assert!(m.forward_from_stem(&Tensor::zeros(&[3, d]).unwrap()).is_err());
    assert!(m.forward_from_stem(&Tensor::zeros(&[64, d + 1]).unwrap()).is_err());
    assert!(m.forward_from_stem(&Tensor::zeros(&[0, d]).unwrap()).is_err());
}
