//! The V-MoE's CUDA ops (layer norm, GELU, bias gradients, cross-entropy, routing, attention,
//! AdamW) checked against their CPU references. Each needs a CUDA device (or NVRTC), so each is
//! `#[ignore]`d with that reason and run by `scripts/gpu-check` (`--include-ignored`); run there
//! without one, a test fails naming why.
#![cfg(feature = "cuda")]

use troupe_kernels::cuda::CudaAdamW;
use troupe_kernels::ops::{
    AdamW, Attention, AttentionBackward, AttentionParams, BiasGrad, CrossEntropy, Gelu, GeluBackward,
    LayerNorm, LayerNormBackward, Op, TopKRouting,
};
use troupe_kernels::{CudaDevice, Device, KernelError, Tensor};

/// The GPU these tests need; fails the test naming why there is none.
fn gpu() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + 1.0) * 0.618 + seed as f32 * 1.37).sin()).collect()
}

fn tensor(seed: u32, shape: &[usize]) -> Tensor {
    Tensor::from_f32(shape, values(seed, shape.iter().product())).expect("a test tensor")
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: gpu {g} vs cpu {w}");
    }
}

#[test]
#[ignore = "needs NVRTC (CUDA): run by scripts/gpu-check"]
fn vmoe_kernel_source_compiles_with_nvrtc() {
    // NVRTC needs no GPU: this runs wherever libnvrtc is on the library path.
    match troupe_kernels::cuda::vmoe_kernels_ptx() {
        Ok(ptx) => {
            for entry in [
                "ln_fwd",
                "ln_bwd_dx",
                "col_sum",
                "col_dot",
                "gelu_fwd",
                "gelu_bwd",
                "xent_rows",
                "adamw_step",
                "attn_fwd",
                "attn_bwd_q",
                "attn_bwd_kv",
            ] {
                assert!(ptx.contains(&format!(".entry {entry}")), "{entry} missing from PTX");
            }
        }
        Err(KernelError::CudaUnavailable(reason)) => panic!("this test needs NVRTC: {reason}"),
        Err(e) => panic!("NVRTC rejected the kernel source: {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn layer_norm_forward_and_backward_match_cpu() {
    let dev = Device::Cuda(gpu());
    let (rows, cols) = (37, 48);
    let (x, gamma, beta, dy) =
        (tensor(1, &[rows, cols]), tensor(2, &[cols]), tensor(3, &[cols]), tensor(4, &[rows, cols]));
    let op = LayerNorm { eps: 1e-5 };
    let (want, want_cache) = op.cpu((&x, &gamma, &beta)).unwrap();
    let (got, got_cache) = op.run(&dev, (&x, &gamma, &beta)).unwrap();
    assert_close("layer_norm y", &got.to_vec_f32(), &want.to_vec_f32(), 1e-5);
    assert_close("layer_norm x_hat", &got_cache.x_hat, &want_cache.x_hat, 1e-5);
    assert_close("layer_norm rstd", &got_cache.rstd, &want_cache.rstd, 1e-5);
    let want = LayerNormBackward.cpu((&dy, &gamma, &want_cache)).unwrap();
    let got = LayerNormBackward.run(&dev, (&dy, &gamma, &want_cache)).unwrap();
    assert_close("layer_norm dx", &got.dx.to_vec_f32(), &want.dx.to_vec_f32(), 1e-5);
    assert_close("layer_norm dgamma", &got.dgamma.to_vec_f32(), &want.dgamma.to_vec_f32(), 1e-5);
    assert_close("layer_norm dbeta", &got.dbeta.to_vec_f32(), &want.dbeta.to_vec_f32(), 1e-5);
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn gelu_bias_grad_and_cross_entropy_match_cpu() {
    let dev = Device::Cuda(gpu());
    let (x, dy) = (tensor(5, &[19, 33]), tensor(6, &[19, 33]));
    assert_close(
        "gelu",
        &Gelu.run(&dev, &x).unwrap().to_vec_f32(),
        &Gelu.cpu(&x).unwrap().to_vec_f32(),
        1e-5,
    );
    let (got, want) = (GeluBackward.run(&dev, (&x, &dy)).unwrap(), GeluBackward.cpu((&x, &dy)).unwrap());
    assert_close("gelu_backward", &got.to_vec_f32(), &want.to_vec_f32(), 1e-5);
    let (got, want) = (BiasGrad.run(&dev, &dy).unwrap(), BiasGrad.cpu(&dy).unwrap());
    assert_close("bias_grad", &got.to_vec_f32(), &want.to_vec_f32(), 1e-5);
    let logits = Tensor::from_f32(&[19, 33], values(7, 19 * 33).iter().map(|v| v * 4.0).collect()).unwrap();
    let targets: Vec<usize> = (0..19).map(|i| (i * 7) % 33).collect();
    let (gl, gg) = CrossEntropy.run(&dev, (&logits, &targets)).unwrap();
    let (wl, wg) = CrossEntropy.cpu((&logits, &targets)).unwrap();
    assert_close("cross_entropy loss", &[gl], &[wl], 1e-5);
    assert_close("cross_entropy grad", &gg.to_vec_f32(), &wg.to_vec_f32(), 1e-5);
    // A target outside the classes is refused before anything reaches the device.
    let bad: Vec<usize> = (0..19).map(|i| if i == 3 { 33 } else { 0 }).collect();
    assert!(matches!(CrossEntropy.run(&dev, (&logits, &bad)), Err(KernelError::InvalidArgument { .. })));
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn routing_on_the_gpu_makes_the_cpu_decision() {
    let dev = Device::Cuda(gpu());
    let logits = Tensor::from_f32(&[64, 8], values(8, 64 * 8).iter().map(|v| v * 3.0).collect()).unwrap();
    let op = TopKRouting { k: 2, capacity: 12 };
    let (got, want) = (op.run(&dev, &logits).unwrap(), op.cpu(&logits).unwrap());
    assert_close("router probs", &got.probs.to_vec_f32(), &want.probs.to_vec_f32(), 1e-5);
    let tokens = |r: &troupe_kernels::ops::Routing| -> Vec<Vec<usize>> {
        r.experts.iter().map(|a| a.iter().map(|s| s.token).collect()).collect()
    };
    assert_eq!(tokens(&got), tokens(&want), "the same tokens on the same experts, in slot order");
    assert_eq!(got.dropped, want.dropped);
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn attention_forward_and_backward_match_cpu() {
    let dev = Device::Cuda(gpu());
    // The sprite student's shape: 16 tokens per image, width 48 in 4 heads (dh 12), 3 images.
    let (seqs, seq_len, dim, heads) = (3, 16, 48, 4);
    let rows = seqs * seq_len;
    let x = tensor(9, &[rows, dim]);
    let scaled = |seed: u32| {
        Tensor::from_f32(&[dim, dim], values(seed, dim * dim).iter().map(|v| v * 0.2).collect()).unwrap()
    };
    let p = AttentionParams { wq: scaled(10), wk: scaled(11), wv: scaled(12), wo: scaled(13) };
    let op = Attention { seq_len, heads };
    let (want, want_cache) = op.cpu((&x, &p)).unwrap();
    let (got, got_cache) = op.run(&dev, (&x, &p)).unwrap();
    assert_close("attention y", &got.to_vec_f32(), &want.to_vec_f32(), 1e-4);
    assert_close("attention probs", &got_cache.probs, &want_cache.probs, 1e-4);
    assert_close("attention q (head-major)", &got_cache.q, &want_cache.q, 1e-4);
    let dy = tensor(14, &[rows, dim]);
    let want = AttentionBackward.cpu((&dy, &p, &want_cache)).unwrap();
    let got = AttentionBackward.run(&dev, (&dy, &p, &want_cache)).unwrap();
    assert_close("attention dx", &got.dx.to_vec_f32(), &want.dx.to_vec_f32(), 1e-4);
    for (name, g, w) in [
        ("dwq", &got.params.wq, &want.params.wq),
        ("dwk", &got.params.wk, &want.params.wk),
        ("dwv", &got.params.wv, &want.params.wv),
        ("dwo", &got.params.wo, &want.params.wo),
    ] {
        assert_close(name, &g.to_vec_f32(), &w.to_vec_f32(), 1e-4);
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn adamw_with_moments_on_the_device_matches_cpu() {
    let gpu = gpu();
    let n = 1000;
    let mut cpu = AdamW::new(0.01);
    let mut on_gpu = CudaAdamW::new(&gpu, AdamW::new(0.01), n).unwrap();
    assert_eq!(on_gpu.state_bytes(), (2 * n * 4) as u64, "moments allocated at construction");
    let (mut p_cpu, mut p_gpu) = (values(15, n), values(15, n));
    for step in 0..5 {
        let g = values(16 + step, n);
        cpu.step(&mut p_cpu, &g).unwrap();
        on_gpu.step(&gpu, &mut p_gpu, &g).unwrap();
    }
    assert_close("adamw params after 5 steps", &p_gpu, &p_cpu, 1e-5);
    assert!(on_gpu.step(&gpu, &mut p_gpu[..10], &values(1, 10)).is_err(), "length fixed at construction");
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn sprite_training_steps_on_the_gpu_match_the_cpu() {
    use rand::SeedableRng;
    use troupe_kernels::vmoe::{TrainScope, Trainer, VMoe, VMoeConfig};
    let gpu = gpu();
    let model =
        VMoe::new(VMoeConfig::sprite(), &mut rand::rngs::SmallRng::seed_from_u64(3)).expect("a model");
    let n = 8;
    let images = Tensor::from_f32(&[n, 64], (0..n * 64).map(|i| ((i * 37) % 17) as f32 / 16.0).collect())
        .expect("a batch");
    let labels: Vec<usize> = (0..n).map(|i| i % 10).collect();
    // Forward and backward through every op on the device.
    let (want_logits, want_cache) = model.forward(&images).expect("cpu forward");
    let (got_logits, got_cache) = model.forward_on(&Device::Cuda(gpu.clone()), &images).expect("gpu forward");
    assert_close("logits", &got_logits.to_vec_f32(), &want_logits.to_vec_f32(), 1e-3);
    let dlogits = tensor(21, &[n, 10]);
    let want = model.backward(&want_cache, &dlogits).expect("cpu backward");
    let got = model.backward_on(&Device::Cuda(gpu.clone()), &got_cache, &dlogits).expect("gpu backward");
    for ((name, g), (_, w)) in got.tensors().iter().zip(want.tensors()) {
        assert_close(&format!("grad {name:?}"), &g.to_vec_f32(), &w.to_vec_f32(), 1e-3);
    }
    // Three adaptation steps: moments on the device, the same parameters as the CPU's.
    let scope = TrainScope::ExpertsAndProjector;
    let (mut on_cpu, mut on_gpu) = (model.clone(), model);
    let mut cpu = Trainer::new(&on_cpu, scope, 0.003, 0.01);
    let mut cuda =
        Trainer::on_device(&on_gpu, scope, 0.003, 0.01, Device::Cuda(gpu)).expect("moments on the gpu");
    for _ in 0..3 {
        let lc = cpu.step(&mut on_cpu, &images, &labels).expect("cpu step");
        let lg = cuda.step(&mut on_gpu, &images, &labels).expect("gpu step");
        assert_close("loss", &[lg], &[lc], 1e-3);
    }
    for ((name, g), (_, w)) in on_gpu.params.tensors().iter().zip(on_cpu.params.tensors()) {
        assert_close(&format!("param {name:?}"), &g.to_vec_f32(), &w.to_vec_f32(), 1e-3);
    }
}
