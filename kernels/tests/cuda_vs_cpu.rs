//! CUDA implementations checked against the CPU references. Every test needs a CUDA device (or
//! NVRTC), so each is `#[ignore]`d with that reason and run by `scripts/gpu-check`
//! (`--include-ignored`) on a GPU machine; run there without one, a test fails naming why.
#![cfg(all(feature = "cuda", feature = "onnx"))]

use troupe_kernels::mlp_engine::{ArenaMlp, MlpEngine};
use troupe_kernels::onnx::mlp_graph::MlpLimits;
use troupe_kernels::onnx::writer::{DenseLayer, mlp_model};
use troupe_kernels::ops::{
    BiasAdd, ExpertParams, Matmul, MoeFfn, MoeFfnBackward, Op, Relu, Softmax, moe_ffn_backward,
    moe_ffn_forward, top_k_route,
};
use troupe_kernels::{CudaDevice, Device, DeviceBytes, KernelError, Tensor, Tier, WeightStore};

/// The GPU these tests need; fails the test naming why there is none.
fn gpu() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

/// A weight store's folder: in the target directory when it exists here (a real disk), else in
/// the system's temp dir (a GPU machine that runs a carried test binary).
fn store_dir() -> tempfile::TempDir {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = if base.is_dir() { tempfile::tempdir_in(base) } else { tempfile::tempdir() };
    dir.unwrap_or_else(|e| panic!("a temporary store folder: {e}"))
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + 1.0) * 0.618 + seed as f32 * 1.37).sin()).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: gpu {g} vs cpu {w}");
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn gemm_matches_cpu_for_all_transposes() {
    let gpu = gpu();
    let dev = Device::Cuda(gpu);
    let (m, k, n) = (37, 53, 29);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let a_shape = if ta { [k, m] } else { [m, k] };
        let b_shape = if tb { [n, k] } else { [k, n] };
        let a = Tensor::from_f32(&a_shape, values(1, m * k)).unwrap();
        let b = Tensor::from_f32(&b_shape, values(2, k * n)).unwrap();
        let op = Matmul { trans_a: ta, trans_b: tb };
        let want = op.cpu((&a, &b)).unwrap();
        let got = op.run(&dev, (&a, &b)).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert_close(&format!("gemm ta={ta} tb={tb}"), &got.to_vec_f32(), &want.to_vec_f32(), 1e-4);
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn moe_forward_and_backward_match_cpu() {
    let gpu = gpu();
    let dev = Device::Cuda(gpu);
    let (t, d, h, e) = (40, 16, 48, 4);
    let experts: Vec<ExpertParams> = (0..e as u32)
        .map(|i| ExpertParams {
            w1: Tensor::from_f32(&[d, h], values(10 + i, d * h)).unwrap(),
            b1: Tensor::from_f32(&[h], values(20 + i, h)).unwrap(),
            w2: Tensor::from_f32(&[h, d], values(30 + i, h * d)).unwrap(),
            b2: Tensor::from_f32(&[d], values(40 + i, d)).unwrap(),
        })
        .collect();
    let x = Tensor::from_f32(&[t, d], values(3, t * d)).unwrap();
    let logits = Tensor::from_f32(&[t, e], values(4, t * e)).unwrap();
    let routing = top_k_route(&logits, 2, 16).unwrap();
    let dy = Tensor::from_f32(&[t, d], values(5, t * d)).unwrap();

    let (y_cpu, cache_cpu) = moe_ffn_forward(&x, &routing, &experts).unwrap();
    let (y_gpu, cache_gpu) = MoeFfn.run(&dev, (&x, &routing, &experts)).unwrap();
    assert_close("moe y", &y_gpu.to_vec_f32(), &y_cpu.to_vec_f32(), 1e-4);

    let g_cpu = moe_ffn_backward(&dy, &cache_cpu, &experts).unwrap();
    let g_gpu = MoeFfnBackward.run(&dev, (&dy, &cache_gpu, &experts)).unwrap();
    assert_close("moe dx", &g_gpu.dx.to_vec_f32(), &g_cpu.dx.to_vec_f32(), 1e-4);
    for (i, (a, b)) in g_gpu.experts.iter().zip(&g_cpu.experts).enumerate() {
        assert_close(&format!("dw1[{i}]"), &a.w1.to_vec_f32(), &b.w1.to_vec_f32(), 1e-4);
        assert_close(&format!("db1[{i}]"), &a.b1.to_vec_f32(), &b.b1.to_vec_f32(), 1e-4);
        assert_close(&format!("dw2[{i}]"), &a.w2.to_vec_f32(), &b.w2.to_vec_f32(), 1e-4);
        assert_close(&format!("db2[{i}]"), &a.b2.to_vec_f32(), &b.b2.to_vec_f32(), 1e-4);
    }
    for (a, b) in g_gpu.dgates.iter().zip(&g_cpu.dgates) {
        assert_close("dgate", a, b, 1e-4);
    }
}

/// An op with a CPU path only (every op of the crate has both now): what any op without CUDA code
/// answers on a GPU.
struct CpuOnly;

impl Op for CpuOnly {
    type Args<'a> = &'a Tensor;
    type Output = Tensor;
    const NAME: &'static str = "cpu_only";

    fn cpu(&self, x: &Tensor) -> Result<Tensor, KernelError> {
        Ok(x.clone())
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn ops_without_cuda_code_say_unsupported() {
    let gpu = gpu();
    let x = Tensor::zeros(&[2, 2]).unwrap();
    let err = CpuOnly.run(&Device::Cuda(gpu), &x).unwrap_err();
    assert!(matches!(err, KernelError::Unsupported { op: "cpu_only", .. }), "{err}");
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn bias_add_relu_and_softmax_match_cpu() {
    let gpu = gpu();
    let dev = Device::Cuda(gpu);
    let (rows, cols) = (33, 70);
    let x =
        Tensor::from_f32(&[rows, cols], values(3, rows * cols).iter().map(|v| v * 4.0).collect()).unwrap();
    let b = Tensor::from_f32(&[cols], values(4, cols)).unwrap();
    let want = BiasAdd.cpu((&x, &b)).unwrap();
    assert_close("bias_add", &BiasAdd.run(&dev, (&x, &b)).unwrap().to_vec_f32(), &want.to_vec_f32(), 1e-6);
    assert_close("relu", &Relu.run(&dev, &x).unwrap().to_vec_f32(), &Relu.cpu(&x).unwrap().to_vec_f32(), 0.0);
    let got = Softmax.run(&dev, &x).unwrap();
    assert_eq!(got.shape(), &[rows, cols]);
    assert_close("softmax", &got.to_vec_f32(), &Softmax.cpu(&x).unwrap().to_vec_f32(), 1e-5);
}

/// A dense layer with deterministic weights for the MLP engine test.
fn dense(inputs: usize, outputs: usize, seed: u32) -> DenseLayer {
    DenseLayer {
        inputs,
        outputs,
        weights: values(seed, inputs * outputs).iter().map(|v| v * 0.3).collect(),
        bias: values(seed + 100, outputs).iter().map(|v| v * 0.1).collect(),
    }
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn mlp_expert_on_the_gpu_matches_the_cpu_engine() {
    let gpu = gpu();
    // The coe experts' shape: 64 inputs, ReLU hidden layers, softmax over the classes.
    let layers = vec![dense(64, 128, 1), dense(128, 64, 2), dense(64, 10, 3)];
    let bytes = mlp_model(&layers, "x", "probs").unwrap();
    let limits = MlpLimits::default();
    let cpu = MlpEngine::from_onnx(&bytes, &limits, &Device::Cpu).unwrap();
    let cuda = MlpEngine::from_onnx(&bytes, &limits, &Device::Cuda(gpu)).unwrap();
    assert_eq!(cuda.device().name(), "cuda:0");
    for batch in [1, 5, 64] {
        let x: Vec<f32> = values(7 + batch as u32, batch * 64);
        let want = cpu.run(&x, batch).unwrap();
        let got = cuda.run(&x, batch).unwrap();
        assert_close(&format!("mlp batch {batch}"), &got, &want, 1e-5);
    }
    assert!(cuda.run(&[0.0; 3], 1).is_err());
}

#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn store_device_tier_round_trips_through_gpu_memory() {
    let gpu = gpu();
    let dir = store_dir();
    let mut s = WeightStore::open(dir.path(), &Device::Cuda(gpu), 1 << 20, 1 << 20).unwrap();
    let data: Vec<u8> = (0..200_003u32).map(|i| (i % 253) as u8).collect();
    let id = s.put("gpu-blob", &data).unwrap();
    s.promote_to_device(&id).unwrap();
    assert_eq!(s.tier(&id).unwrap(), Tier::Device);
    assert!(s.cuda_arena().is_some());
    assert_eq!(s.read(&id).unwrap(), data);
    assert_eq!(s.evict(&id).unwrap(), Tier::Host);
    assert_eq!(s.read(&id).unwrap(), data);
}

/// The MLP engine reading an expert in place from a GPU store arena answers as the CPU engine,
/// also after a compaction moved the expert's bytes.
#[test]
#[ignore = "needs a CUDA device: run by scripts/gpu-check"]
fn mlp_read_in_place_from_the_gpu_arena_matches_the_cpu_engine() {
    let gpu = gpu();
    let dir = store_dir();
    let mut s = WeightStore::open(dir.path(), &Device::Cuda(gpu.clone()), 4 << 20, 4 << 20).unwrap();
    let spacer = s.put("spacer", &vec![7u8; 300_001]).unwrap();
    let bytes = mlp_model(&[dense(64, 128, 1), dense(128, 64, 2), dense(64, 10, 3)], "x", "probs").unwrap();
    let id = s.put("expert", &bytes).unwrap();
    s.promote_to_device(&spacer).unwrap();
    s.promote_to_device(&id).unwrap();
    let limits = MlpLimits::default();
    let layout = ArenaMlp::from_onnx(&bytes, &limits).unwrap().expect("the writer aligns the weights");
    let cpu = MlpEngine::from_onnx(&bytes, &limits, &Device::Cpu).unwrap();
    let run = |s: &WeightStore, x: &[f32], batch: usize| match s.device_bytes(&id).unwrap() {
        DeviceBytes::Cuda { arena, offset, len } => {
            assert_eq!(len, layout.file_len());
            (offset, layout.run_cuda(&gpu, arena, offset, x, batch).unwrap())
        }
        DeviceBytes::Host(_) => panic!("a CUDA store's arena is GPU memory"),
    };
    let x: Vec<f32> = values(11, 5 * 64);
    let want = cpu.run(&x, 5).unwrap();
    let (before, got) = run(&s, &x, 5);
    assert_close("in place", &got, &want, 1e-5);
    // The spacer leaves; compaction moves the expert to offset 0.
    s.evict(&spacer).unwrap();
    s.compact_device().unwrap();
    let (after, got) = run(&s, &x, 5);
    assert!(after < before, "moved from {before} to {after}");
    assert_close("in place after compaction", &got, &want, 1e-5);
}

#[test]
#[ignore = "needs NVRTC (CUDA): run by scripts/gpu-check"]
fn ffn_kernel_source_compiles_with_nvrtc() {
    // NVRTC needs no GPU: this runs wherever libnvrtc is on the library path.
    match troupe_kernels::cuda::ffn_kernels_ptx() {
        Ok(ptx) => {
            for entry in
                ["bias_gelu_fwd", "bias_add_rows", "gelu_bwd_inplace", "relu_inplace", "softmax_rows"]
            {
                assert!(ptx.contains(&format!(".entry {entry}")), "{entry} missing from PTX");
            }
        }
        Err(KernelError::CudaUnavailable(reason)) => panic!("this test needs NVRTC: {reason}"),
        Err(e) => panic!("NVRTC rejected the kernel source: {e}"),
    }
}
