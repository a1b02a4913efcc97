//! The executors' engines on real experts of a generated ci app: a GPU executor runs the MLP
//! engine on CUDA when a device opens and is otherwise the named ONNX Runtime stand-in; a CPU
//! executor asked for the MLP engine answers as ONNX Runtime does (within 1e-5) through loads,
//! demotions and promotions, with the same memory accounting. Needs `scripts/setup` (digits and
//! ONNX Runtime).
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::executor::{ExecutorOptions, ExpertExecutor, gpu_name, standin_name};
use troupe_policy::coe::{ExecutorKind, ExpertEngine, ExpertId};

mod common;
use common::{generated_app, no_baseline};

/// A fresh ci app in a temporary folder.
fn ci_app() -> (tempfile::TempDir, App) {
    let tmp = tempfile::tempdir().expect("temp dir");
    generated_app(tmp.path(), Scale::Ci, 5, &no_baseline());
    let app = App::open(tmp.path(), None).expect("opening the app");
    (tmp, app)
}

/// Executor `name` of `kind` over all of `app`'s experts (budget: the whole model).
fn open(app: &App, name: &str, kind: ExecutorKind, mlp_on_cpu: bool) -> ExpertExecutor {
    let model = &app.trace.model;
    let options = ExecutorOptions {
        kind,
        mlp_on_cpu,
        host_budget: Some(model.total_bytes()),
        ..ExecutorOptions::new(model.total_bytes())
    };
    ExpertExecutor::open_with(name, &app.store_dir(), &app.manifest, model, options).expect("opening")
}

/// The largest difference between two batches of output rows.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "row counts");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "row widths");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Every expert of `app` on a batch of digits in `exec` and in `reference`, compared.
fn assert_same_answers(app: &App, exec: &mut ExpertExecutor, reference: &mut ExpertExecutor) {
    let inputs: Vec<Vec<f32>> = (0..6).map(|i| app.input(i)).collect();
    for e in 0..app.trace.model.len() as u32 {
        let e = ExpertId(e);
        exec.load(e).unwrap();
        reference.load(e).unwrap();
        let got = exec.run_batch(e, &inputs).unwrap();
        let want = reference.run_batch(e, &inputs).unwrap();
        let d = max_diff(&got, &want);
        assert!(
            d <= 1e-5,
            "{e} on {}: {} differs from onnx runtime by {d}",
            exec.name(),
            exec.engine().label()
        );
        assert_ne!(got[0], got[1], "{e}: different digits give different outputs");
        // Out and back in (demoted to the host tier, then promoted): the same answers.
        exec.evict(e).unwrap();
        exec.load(e).unwrap();
        assert_eq!(exec.run_batch(e, &inputs).unwrap(), got, "{e} after demotion and promotion");
        exec.check_accounting().unwrap();
        exec.evict(e).unwrap();
        reference.evict(e).unwrap();
    }
    let c = exec.counters();
    assert!(c.promotions > 0, "{c:?}");
    // The MLP engine reads the generated app's weights in place (the writer aligns them): the
    // arena's copy, which the pool accounts, is the only one. ONNX Runtime keeps its own.
    let in_place = matches!(exec.engine(), ExpertEngine::MlpCpu | ExpertEngine::MlpCuda);
    assert_eq!(c.in_arena_loads, if in_place { c.loads } else { 0 }, "{c:?}");
}

#[test]
fn cpu_executor_on_the_mlp_engine_answers_as_onnx_runtime() {
    let (_tmp, app) = ci_app();
    let mut mlp = open(&app, "cpu0", ExecutorKind::Cpu, true);
    let mut ort = open(&app, "cpu1", ExecutorKind::Cpu, false);
    assert_eq!(mlp.engine(), ExpertEngine::MlpCpu);
    assert_eq!(ort.engine(), ExpertEngine::OnnxCpu, "ONNX Runtime stays the CPU default");
    assert_eq!(mlp.counters().engine, Some(ExpertEngine::MlpCpu));
    assert_same_answers(&app, &mut mlp, &mut ort);
}

/// With CUDA (on a GPU machine) the GPU executor is `gpu0` on `cuda:0` and answers as ONNX
/// Runtime does; without, it is the stand-in, on the CPU, and says so.
#[test]
fn gpu_executor_runs_on_cuda_or_is_the_named_standin() {
    let (_tmp, app) = ci_app();
    let name = gpu_name(0);
    let mut gpu = open(&app, &name, ExecutorKind::Gpu, false);
    let mut ort = open(&app, "cpu0", ExecutorKind::Cpu, false);
    match troupe_kernels::cuda::cuda_available(0) {
        Ok(()) => {
            assert_eq!(name, "gpu0");
            assert_eq!(gpu.engine(), ExpertEngine::MlpCuda);
            assert_eq!(gpu.device_name(), "cuda:0");
        }
        Err(reason) => {
            eprintln!("no CUDA here ({reason}): checking the stand-in");
            assert_eq!(name, standin_name(0));
            assert_eq!(gpu.engine(), ExpertEngine::StandinCpu);
            assert_eq!(gpu.engine().label(), "standin-cpu");
            assert_eq!(gpu.device_name(), "cpu");
        }
    }
    assert_eq!(gpu.counters().engine, Some(gpu.engine()));
    assert_same_answers(&app, &mut gpu, &mut ort);
}
