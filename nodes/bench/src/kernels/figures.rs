//! Kernel benchmark figures for `troupe bench kernels`.
//!
//! Every ratio compares two things measured in the same run on the same machine:
//! - `gemm_fraction_of_peak`: single-threaded `matrixmultiply` SGEMM (n x n x n) over the
//!   single-core peak of the widest instruction set it dispatches to (AVX-512 when the CPU has it,
//!   else AVX2 + FMA), measured by an inline-assembly microkernel of 14 independent `vfmadd` chains
//!   (enough to cover FMA latency x ports). Being assembly, the peak is right even in an
//!   unoptimised build; the GEMM itself is a dependency and always optimised.
//!   `peak_gflops_all_cores` runs the microkernel on every core at once (on a shared machine other
//!   load lowers it). `theoretical_peak_gflops_per_core` is `cpu MHz` from /proc/cpuinfo x 2 FMA
//!   units x lanes x 2 (an assumption about the core; a VM's reported MHz may be nominal).
//! - `disk_load_over_odirect`: `WeightStore::load_to_host` (O_DIRECT read + blake3 verify + tier
//!   bookkeeping) over a plain O_DIRECT read of the same bytes of the same file.
//! - `moe_ffn_fwd_bwd_us_per_token`: CPU MoE expert FFN forward + backward per routed token.
//!
//! Times are medians of `reps` runs, except GEMM and peak: best of `2 x reps` interleaved rounds.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use troupe_policy::stats::median_of;

use troupe_kernels::cpu_time::thread_cpu_seconds;
use troupe_kernels::device::Device;
use troupe_kernels::direct_io::{ReadMode, read_range};
use troupe_kernels::error::Result;
use troupe_kernels::ops::{ExpertParams, Gemm, moe_ffn_backward, moe_ffn_forward, top_k_route};
use troupe_kernels::store::WeightStore;
use troupe_kernels::tensor::Tensor;

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Directory for the disk figures (must be on the disk to measure, not tmpfs).
    pub dir: PathBuf,
    /// GEMM size n (n x n x n).
    pub gemm_n: usize,
    /// Blob size for the disk figures, MiB.
    pub disk_mib: usize,
    /// Repetitions per figure (the median is reported).
    pub reps: usize,
    /// MoE batch: tokens, model width, hidden width, experts, k.
    pub moe: (usize, usize, usize, usize, usize),
    /// Also time cuBLAS GEMM when a GPU is usable.
    pub try_cuda: bool,
}

impl BenchConfig {
    /// Defaults sized to finish in well under 20 s on 2 cores (release build).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            gemm_n: 512,
            disk_mib: 64,
            reps: 5,
            moe: (256, 128, 512, 8, 2),
            try_cuda: true,
        }
    }
}

/// The figures.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelBench {
    /// Single-threaded SGEMM throughput (best round).
    pub gemm_gflops: f64,
    /// Single-core FMA peak of the GEMM's instruction set, measured (best round).
    pub peak_gflops: f64,
    /// The same microkernel on every core at once.
    pub peak_gflops_all_cores: f64,
    /// From /proc/cpuinfo (see the module docs), when readable.
    pub theoretical_peak_gflops_per_core: Option<f64>,
    /// `gemm_gflops / peak_gflops`.
    pub gemm_fraction_of_peak: f64,
    /// CPU MoE expert FFN forward + backward, microseconds per token.
    pub moe_ffn_fwd_bwd_us_per_token: f64,
    /// Weight-store disk -> host load bandwidth, MB/s.
    pub disk_load_mb_s: f64,
    /// Plain O_DIRECT read bandwidth of the same file, MB/s.
    pub odirect_read_mb_s: f64,
    /// `disk_load_mb_s / odirect_read_mb_s`.
    pub disk_load_over_odirect: f64,
    /// The filesystem refused O_DIRECT (disk figures then include the page cache).
    pub odirect_fallback: bool,
    /// Whether the peak came from the assembly microkernel (false: a portable Rust loop).
    pub peak_from_asm: bool,
    /// f32 lanes of the peak kernel (16: AVX-512, 8: AVX2 + FMA), the widest `matrixmultiply` uses.
    pub peak_vector_lanes: usize,
    /// cuBLAS SGEMM throughput (4096^3, data resident), when a GPU was usable.
    pub cuda_gemm_gflops: Option<f64>,
    /// Built without optimisations (our crate's loops are then slow; GEMM and the peak are not).
    pub debug_build: bool,
}

impl KernelBench {
    /// Flat `name -> value` map (booleans as 0/1; absent options left out).
    pub fn to_json_map(&self) -> BTreeMap<String, f64> {
        let b = |v: bool| if v { 1.0 } else { 0.0 };
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("gemm_gflops", self.gemm_gflops),
            ("peak_gflops", self.peak_gflops),
            ("peak_gflops_all_cores", self.peak_gflops_all_cores),
            ("gemm_fraction_of_peak", self.gemm_fraction_of_peak),
            ("moe_ffn_fwd_bwd_us_per_token", self.moe_ffn_fwd_bwd_us_per_token),
            ("disk_load_mb_s", self.disk_load_mb_s),
            ("odirect_read_mb_s", self.odirect_read_mb_s),
            ("disk_load_over_odirect", self.disk_load_over_odirect),
            ("odirect_fallback", b(self.odirect_fallback)),
            ("peak_from_asm", b(self.peak_from_asm)),
            ("peak_vector_lanes", self.peak_vector_lanes as f64),
            ("debug_build", b(self.debug_build)),
        ] {
            m.insert(k.to_string(), v);
        }
        if let Some(v) = self.theoretical_peak_gflops_per_core {
            m.insert("theoretical_peak_gflops_per_core".to_string(), v);
        }
        if let Some(v) = self.cuda_gemm_gflops {
            m.insert("cuda_gemm_gflops".to_string(), v);
        }
        m
    }
}

fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(median_of(t))
}

mod fma {
    //! FMA-throughput microkernels: 14 independent FMA chains (more than latency x ports on current
    //! cores; 14 + 2 operands fill the 16 vector registers), written in assembly so the figure does
    //! not depend on the build's optimisation level.

    /// Independent accumulator chains.
    pub const CHAINS: usize = 14;

    /// Which kernel runs on this CPU; matches the widest kernel `matrixmultiply` dispatches to.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// 16-lane `vfmadd213ps zmm`.
        Avx512,
        /// 8-lane `vfmadd213ps ymm`.
        Avx2Fma,
        /// Portable Rust loop (approximate; meaningful only in an optimised build).
        Portable,
    }

    impl Kind {
        /// f32 lanes per instruction.
        pub fn lanes(self) -> usize {
            match self {
                Kind::Avx512 => 16,
                Kind::Avx2Fma | Kind::Portable => 8,
            }
        }

        /// Flops per loop iteration (chains x lanes x 2).
        pub fn flops_per_iter(self) -> f64 {
            (CHAINS * self.lanes() * 2) as f64
        }
    }

    /// The best kernel this CPU runs.
    pub fn detect() -> Kind {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Kind::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Kind::Avx2Fma;
            }
        }
        Kind::Portable
    }

    /// `iters` iterations of kernel `kind`; returns a value so nothing is elided.
    pub fn burst(kind: Kind, iters: u64) -> f32 {
        if iters == 0 {
            return 0.0;
        }
        #[cfg(target_arch = "x86_64")]
        match kind {
            // SAFETY: `detect` confirmed the CPU features before choosing these kinds.
            Kind::Avx512 => return unsafe { burst_avx512(iters) },
            // SAFETY: as above.
            Kind::Avx2Fma => return unsafe { burst_avx2(iters) },
            Kind::Portable => {}
        }
        let _ = kind;
        portable(iters)
    }

    fn portable(iters: u64) -> f32 {
        let mut acc = [[1.0f32; 8]; CHAINS];
        for _ in 0..iters {
            for chain in acc.iter_mut() {
                for v in chain.iter_mut() {
                    *v = *v * 0.999_999 + 1e-6;
                }
            }
        }
        acc.iter().flatten().sum()
    }

    /// Emits the 14-chain FMA loop for one register class.
    #[cfg(target_arch = "x86_64")]
    macro_rules! fma_loop {
        ($reg:ident, $iters:expr, $m:expr, $c:expr, $a:ident) => {
            // SAFETY: register-only arithmetic; `n` counts down from a non-zero value to zero.
            unsafe {
                std::arch::asm!(
                    "2:",
                    "vfmadd213ps {a0}, {m}, {c}",
                    "vfmadd213ps {a1}, {m}, {c}",
                    "vfmadd213ps {a2}, {m}, {c}",
                    "vfmadd213ps {a3}, {m}, {c}",
                    "vfmadd213ps {a4}, {m}, {c}",
                    "vfmadd213ps {a5}, {m}, {c}",
                    "vfmadd213ps {a6}, {m}, {c}",
                    "vfmadd213ps {a7}, {m}, {c}",
                    "vfmadd213ps {a8}, {m}, {c}",
                    "vfmadd213ps {a9}, {m}, {c}",
                    "vfmadd213ps {a10}, {m}, {c}",
                    "vfmadd213ps {a11}, {m}, {c}",
                    "vfmadd213ps {a12}, {m}, {c}",
                    "vfmadd213ps {a13}, {m}, {c}",
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) $iters => _,
                    a0 = inout($reg) $a[0], a1 = inout($reg) $a[1], a2 = inout($reg) $a[2],
                    a3 = inout($reg) $a[3], a4 = inout($reg) $a[4], a5 = inout($reg) $a[5],
                    a6 = inout($reg) $a[6], a7 = inout($reg) $a[7], a8 = inout($reg) $a[8],
                    a9 = inout($reg) $a[9], a10 = inout($reg) $a[10], a11 = inout($reg) $a[11],
                    a12 = inout($reg) $a[12], a13 = inout($reg) $a[13],
                    m = in($reg) $m,
                    c = in($reg) $c,
                    options(nomem, nostack),
                );
            }
        };
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn burst_avx2(iters: u64) -> f32 {
        use std::arch::x86_64::*;
        let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-6));
        let mut a = [_mm256_set1_ps(1.0); CHAINS];
        fma_loop!(ymm_reg, iters, m, c, a);
        let mut out = [0f32; 8];
        a.iter()
            .map(|v| {
                // SAFETY: `out` has room for 8 f32s.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *v) };
                out.iter().sum::<f32>()
            })
            .sum()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn burst_avx512(iters: u64) -> f32 {
        use std::arch::x86_64::*;
        let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-6));
        let mut a = [_mm512_set1_ps(1.0); CHAINS];
        fma_loop!(zmm_reg, iters, m, c, a);
        a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
}

/// Single-threaded SGEMM (n x n x n) and the single-core FMA peak, measured interleaved (one
/// GEMM, ten ~1 ms peak bursts, `rounds` times) so both see the same machine, timed in thread CPU
/// time (preemption by other processes does not count), best of the rounds for each (a peak is a
/// maximum; on a shared machine best-of-N is the figure that reflects the core).
/// Returns `(gemm GFLOP/s, peak GFLOP/s, f32 lanes of the peak kernel, peak from assembly)`.
pub fn gemm_and_peak_gflops(n: usize, rounds: usize) -> Result<(f64, f64, usize, bool)> {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 17) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut c = vec![0.0; n * n];
    let g = Gemm::new(n, n, n);
    let kind = fma::detect();
    let asm = kind != fma::Kind::Portable;
    // ~1 ms per burst with the assembly kernels, so a burst fits in a scheduler time slice.
    let iters: u64 = if asm { 300_000 } else { 30_000 };
    g.run_cpu(&a, &b, &mut c)?;
    std::hint::black_box(fma::burst(kind, iters * 20));
    let (mut gemm_best, mut peak_best) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..rounds.max(1) {
        let s = thread_cpu_seconds();
        g.run_cpu(&a, &b, &mut c)?;
        gemm_best = gemm_best.min(thread_cpu_seconds() - s);
        for _ in 0..10 {
            let s = thread_cpu_seconds();
            std::hint::black_box(fma::burst(kind, iters));
            peak_best = peak_best.min(thread_cpu_seconds() - s);
        }
    }
    std::hint::black_box(&c);
    Ok((
        2.0 * (n as f64).powi(3) / gemm_best / 1e9,
        iters as f64 * kind.flops_per_iter() / peak_best / 1e9,
        kind.lanes(),
        asm,
    ))
}

/// The FMA microkernel on every core at once, GFLOP/s (best of `rounds`).
pub fn peak_gflops_all_cores(rounds: usize) -> f64 {
    let kind = fma::detect();
    let iters: u64 = if kind == fma::Kind::Portable { 100_000 } else { 1_000_000 };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut best = f64::INFINITY;
    for _ in 0..rounds.max(1) {
        let s = Instant::now();
        std::thread::scope(|sc| {
            for _ in 0..threads {
                sc.spawn(|| std::hint::black_box(fma::burst(kind, iters)));
            }
        });
        best = best.min(s.elapsed().as_secs_f64());
    }
    threads as f64 * iters as f64 * kind.flops_per_iter() / best / 1e9
}

/// `cpu MHz` from /proc/cpuinfo x 2 FMA units x `lanes` x 2 flops.
pub fn theoretical_peak_gflops_per_core(lanes: usize) -> Option<f64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()?;
    Some(mhz * 1e6 * 4.0 * lanes as f64 / 1e9)
}

fn moe_us_per_token(shape: (usize, usize, usize, usize, usize), reps: usize) -> Result<f64> {
    let (t, d, h, e, k) = shape;
    let v = |seed: usize, n: usize, s: f32| -> Vec<f32> {
        (0..n).map(|i| (((i * 7 + seed * 13) % 101) as f32 / 50.0 - 1.0) * s).collect()
    };
    let experts: Vec<ExpertParams> = (0..e)
        .map(|i| -> Result<ExpertParams> {
            Ok(ExpertParams {
                w1: Tensor::from_f32(&[d, h], v(i, d * h, 0.05))?,
                b1: Tensor::from_f32(&[h], v(i + 1, h, 0.01))?,
                w2: Tensor::from_f32(&[h, d], v(i + 2, h * d, 0.05))?,
                b2: Tensor::from_f32(&[d], v(i + 3, d, 0.01))?,
            })
        })
        .collect::<Result<_>>()?;
    let x = Tensor::from_f32(&[t, d], v(100, t * d, 1.0))?;
    let logits = Tensor::from_f32(&[t, e], v(200, t * e, 2.0))?;
    let dy = Tensor::from_f32(&[t, d], v(300, t * d, 1.0))?;
    let capacity = (t * k).div_ceil(e) * 5 / 4;
    let routing = top_k_route(&logits, k, capacity)?;
    let secs = time(reps, || {
        let (_, cache) = moe_ffn_forward(&x, &routing, &experts)?;
        moe_ffn_backward(&dy, &cache, &experts).map(|_| ())
    })?;
    Ok(secs * 1e6 / t as f64)
}

/// `(store load MB/s, plain O_DIRECT MB/s, fallback used)` for a `mib`-MiB blob in `dir`.
fn disk_figures(cfg: &BenchConfig) -> Result<(f64, f64, bool)> {
    let len = cfg.disk_mib << 20;
    let data: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect();
    let mut store = WeightStore::open(&cfg.dir, &Device::Cpu, 0, len as u64)?;
    let id = store.put("bench-disk-blob", &data)?;
    drop(data);
    let path = store.path_of(&id)?.to_path_buf();
    let (mut load_t, mut raw_t, mut fallback) = (Vec::new(), Vec::new(), false);
    for i in 0..cfg.reps.max(1) + 1 {
        let s = Instant::now();
        let (bytes, mode) = read_range(&path, WeightStore::data_offset(), len)?;
        let raw = s.elapsed().as_secs_f64();
        std::hint::black_box(&bytes[..]);
        drop(bytes);
        fallback |= mode == ReadMode::BufferedFallback;
        let s = Instant::now();
        store.load_to_host(&id)?;
        let load = s.elapsed().as_secs_f64();
        store.evict(&id)?;
        if i > 0 {
            raw_t.push(raw);
            load_t.push(load);
        }
    }
    fallback |= store.stats().odirect_fallbacks > 0;
    store.remove(&id)?;
    let mb = len as f64 / 1e6;
    Ok((mb / median_of(load_t), mb / median_of(raw_t), fallback))
}

fn cuda_gemm_gflops() -> Option<f64> {
    let Ok(Device::Cuda(dev)) = Device::cuda(0) else {
        return None;
    };
    let n = 4096;
    let run = || -> Result<f64> {
        let a = dev.upload(&vec![0.5f32; n * n])?;
        let b = dev.upload(&vec![0.25f32; n * n])?;
        let mut c = dev.zeros(n * n)?;
        let g = Gemm::new(n, n, n);
        troupe_kernels::cuda::gemm_device(&dev, &g, &a, &b, &mut c)?;
        dev.sync()?;
        let secs = time(5, || {
            troupe_kernels::cuda::gemm_device(&dev, &g, &a, &b, &mut c)?;
            dev.sync()
        })?;
        Ok(2.0 * (n as f64).powi(3) / secs / 1e9)
    };
    run().ok()
}

/// Run every figure.
pub fn run(cfg: &BenchConfig) -> Result<KernelBench> {
    let (gemm, peak, peak_lanes, peak_from_asm) = gemm_and_peak_gflops(cfg.gemm_n, 2 * cfg.reps)?;
    let peak_all = peak_gflops_all_cores(4 * cfg.reps);
    let moe = moe_us_per_token(cfg.moe, cfg.reps)?;
    let (load, raw, fallback) = disk_figures(cfg)?;
    Ok(KernelBench {
        gemm_gflops: gemm,
        peak_gflops: peak,
        peak_gflops_all_cores: peak_all,
        theoretical_peak_gflops_per_core: theoretical_peak_gflops_per_core(peak_lanes),
        gemm_fraction_of_peak: gemm / peak,
        moe_ffn_fwd_bwd_us_per_token: moe,
        disk_load_mb_s: load,
        odirect_read_mb_s: raw,
        disk_load_over_odirect: load / raw,
        odirect_fallback: fallback,
        peak_from_asm,
        peak_vector_lanes: peak_lanes,
        cuda_gemm_gflops: if cfg.try_cuda { cuda_gemm_gflops() } else { None },
        debug_build: cfg!(debug_assertions),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_bench_produces_sane_figures() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let cfg = BenchConfig {
            dir: dir.path().to_path_buf(),
            gemm_n: 64,
            disk_mib: 2,
            reps: 1,
            moe: (16, 8, 16, 2, 1),
            try_cuda: false,
        };
        let b = run(&cfg).unwrap();
        let m = b.to_json_map();
        for key in [
            "gemm_gflops",
            "peak_gflops",
            "gemm_fraction_of_peak",
            "moe_ffn_fwd_bwd_us_per_token",
            "disk_load_mb_s",
            "odirect_read_mb_s",
            "disk_load_over_odirect",
        ] {
            let v = m[key];
            assert!(v.is_finite() && v > 0.0, "{key} = {v}");
        }
        assert!((b.gemm_fraction_of_peak - b.gemm_gflops / b.peak_gflops).abs() < 1e-12);
        assert!(!m.contains_key("cuda_gemm_gflops"));
        assert_eq!(m["debug_build"], 1.0);
    }
}

#[cfg(test)]
mod manual {
    /// `cargo test -p troupe-bench --release --lib default_bench -- --ignored --nocapture`
    #[test]
    #[ignore = "full-size benchmark; run by hand in a release build"]
    fn default_bench() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let start = std::time::Instant::now();
        let b = super::run(&super::BenchConfig::new(dir.path())).unwrap();
        for (k, v) in b.to_json_map() {
            println!("{k} = {v:.3}");
        }
        println!("took {:.1} s", start.elapsed().as_secs_f64());
    }
}
