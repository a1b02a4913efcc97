//! The ops compose into a trainable V-MoE-style block: router (top-k with capacity) -> expert FFNs
//! -> residual -> linear head -> cross-entropy, backward through all of it, AdamW updates.
//! On a separable synthetic task the loss must fall well below its starting value.

use troupe_kernels::Tensor;
use troupe_kernels::ops::{
    AdamW, ExpertParams, bias_add, bias_grad, cross_entropy, matmul, moe_ffn_backward, moe_ffn_forward,
    top_k_route,
};

const T: usize = 48; // tokens per batch
const D: usize = 8; // model width
const H: usize = 16; // expert hidden width
const E: usize = 4; // experts
const C: usize = 3; // classes

/// Small deterministic generator (the tests need no RNG crate).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn t(shape: &[usize], v: Vec<f32>) -> Tensor {
    Tensor::from_f32(shape, v).expect("shape matches data")
}

/// A batch: class c tokens sit around mean_c (plus noise).
fn batch(rng: &mut Lcg, means: &[Vec<f32>]) -> (Tensor, Vec<usize>) {
    let mut x = Vec::with_capacity(T * D);
    let mut y = Vec::with_capacity(T);
    for i in 0..T {
        let c = i % C;
        y.push(c);
        x.extend(means[c].iter().map(|m| m + 0.8 * rng.next()));
    }
    (t(&[T, D], x), y)
}

fn add(a: &Tensor, b: &Tensor) -> Tensor {
    let v = a.to_vec_f32().iter().zip(b.to_vec_f32()).map(|(x, y)| x + y).collect();
    t(a.shape(), v)
}

#[test]
fn moe_classifier_learns_with_adamw() {
    let mut rng = Lcg(7);
    let means: Vec<Vec<f32>> = (0..C).map(|_| rng.vec(D, 1.0)).collect();
    let mut router = t(&[D, E], rng.vec(D * E, 0.3));
    let mut experts: Vec<ExpertParams> = (0..E)
        .map(|_| ExpertParams {
            w1: t(&[D, H], rng.vec(D * H, 0.3)),
            b1: t(&[H], vec![0.0; H]),
            w2: t(&[H, D], rng.vec(H * D, 0.3)),
            b2: t(&[D], vec![0.0; D]),
        })
        .collect();
    let mut head_w = t(&[D, C], rng.vec(D * C, 0.3));
    let mut head_b = t(&[C], vec![0.0; C]);
    // One optimiser per parameter buffer: router, head w/b, then 4 per expert.
    let mut opts: Vec<AdamW> = (0..3 + 4 * E).map(|_| AdamW::new(0.02)).collect();
    let capacity = T * 2 / E; // k = 2 with no slack: some choices are dropped

    let mut losses = Vec::new();
    let mut dropped_seen = 0;
    for _step in 0..150 {
        let (x, labels) = batch(&mut rng, &means);
        let router_logits = matmul(&x, &router, false, false).unwrap();
        let routing = top_k_route(&router_logits, 2, capacity).unwrap();
        dropped_seen += routing.dropped.len();
        let (moe_out, cache) = moe_ffn_forward(&x, &routing, &experts).unwrap();
        let z = add(&x, &moe_out); // residual
        let logits = bias_add(&matmul(&z, &head_w, false, false).unwrap(), &head_b).unwrap();
        let (loss, dlogits) = cross_entropy(&logits, &labels).unwrap();
        losses.push(loss);

        // Backward.
        let d_head_w = matmul(&z, &dlogits, true, false).unwrap();
        let d_head_b = bias_grad(&dlogits).unwrap();
        let dz = matmul(&dlogits, &head_w, false, true).unwrap();
        let g = moe_ffn_backward(&dz, &cache, &experts).unwrap();
        let d_router_logits = routing.logits_grad(&g.dgates).unwrap();
        let d_router = matmul(&x, &d_router_logits, true, false).unwrap();

        // Updates.
        let mut step = |i: usize, p: &mut Tensor, grad: &Tensor| {
            opts[i].step(p.f32_mut().unwrap(), &grad.to_vec_f32()).unwrap();
        };
        step(0, &mut router, &d_router);
        step(1, &mut head_w, &d_head_w);
        step(2, &mut head_b, &d_head_b);
        for (e, (p, gr)) in experts.iter_mut().zip(&g.experts).enumerate() {
            step(3 + 4 * e, &mut p.w1, &gr.w1);
            step(4 + 4 * e, &mut p.b1, &gr.b1);
            step(5 + 4 * e, &mut p.w2, &gr.w2);
            step(6 + 4 * e, &mut p.b2, &gr.b2);
        }
    }
    let first: f32 = losses[..10].iter().sum::<f32>() / 10.0;
    let last: f32 = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    assert!(dropped_seen > 0, "capacity should have dropped some choices");
    // An untrained model is near or above chance (ln 3 = 1.10); a learnable task ends far below.
    assert!(losses[0] > 1.0, "initial loss {}", losses[0]);
    assert!(last < 0.25 * first && last < 0.3, "loss {first:.3} -> {last:.3}");
}
