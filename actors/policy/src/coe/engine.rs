//! Which engine runs an executor's experts, decided from its kind, whether CUDA is usable and
//! the CPU executor's knob. The executor only carries the answer out.
//!
//! CoServe's executors differ by device: the GPU executor runs experts on the GPU, the CPU one on
//! the CPU. Here a GPU executor runs the MLP engine on CUDA when a device opens; without one it
//! is a *stand-in*, a CPU executor under ONNX Runtime, and every report says so. A CPU executor
//! runs ONNX Runtime unless asked to run the MLP engine on the CPU.

use super::profile::ExecutorKind;

/// The engine that runs an executor's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertEngine {
    /// ONNX Runtime's CPU provider, on a CPU executor.
    OnnxCpu,
    /// ONNX Runtime on the CPU standing in for a GPU executor (no usable CUDA device).
    StandinCpu,
    /// The kernels' MLP engine on the CPU (the CPU executor's optional engine).
    MlpCpu,
    /// The kernels' MLP engine on a CUDA GPU (cuBLAS GEMM, NVRTC kernels).
    MlpCuda,
}

impl ExpertEngine {
    /// The name in reports: `onnxruntime-cpu`, `standin-cpu`, `mlp-cpu` or `cuda`.
    pub fn label(self) -> &'static str {
        match self {
            ExpertEngine::OnnxCpu => "onnxruntime-cpu",
            ExpertEngine::StandinCpu => "standin-cpu",
            ExpertEngine::MlpCpu => "mlp-cpu",
            ExpertEngine::MlpCuda => "cuda",
        }
    }

    /// Whether the experts run through ONNX Runtime (else through the MLP engine).
    pub fn uses_onnx_runtime(self) -> bool {
        matches!(self, ExpertEngine::OnnxCpu | ExpertEngine::StandinCpu)
    }

    /// Whether the experts' weights live on a CUDA device.
    pub fn on_cuda(self) -> bool {
        self == ExpertEngine::MlpCuda
    }
}

/// The engine of an executor of `kind`: a GPU executor runs on CUDA when `cuda_usable`, else it
/// is the CPU stand-in; a CPU executor runs the MLP engine when `cpu_mlp`, else ONNX Runtime.
pub fn choose_engine(kind: ExecutorKind, cuda_usable: bool, cpu_mlp: bool) -> ExpertEngine {
    match kind {
        ExecutorKind::Gpu if cuda_usable => ExpertEngine::MlpCuda,
        ExecutorKind::Gpu => ExpertEngine::StandinCpu,
        ExecutorKind::Cpu if cpu_mlp => ExpertEngine::MlpCpu,
        ExecutorKind::Cpu => ExpertEngine::OnnxCpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_executors_use_cuda_only_when_it_is_usable() {
        assert_eq!(choose_engine(ExecutorKind::Gpu, true, false), ExpertEngine::MlpCuda);
        assert_eq!(choose_engine(ExecutorKind::Gpu, false, false), ExpertEngine::StandinCpu);
        // The CPU knob does not move a GPU executor off its device or its stand-in.
        assert_eq!(choose_engine(ExecutorKind::Gpu, false, true), ExpertEngine::StandinCpu);
        assert_eq!(choose_engine(ExecutorKind::Gpu, true, true), ExpertEngine::MlpCuda);
    }

    #[test]
    fn cpu_executors_keep_onnx_runtime_unless_asked() {
        assert_eq!(choose_engine(ExecutorKind::Cpu, true, false), ExpertEngine::OnnxCpu);
        assert_eq!(choose_engine(ExecutorKind::Cpu, false, true), ExpertEngine::MlpCpu);
        assert_eq!(ExpertEngine::StandinCpu.label(), "standin-cpu");
        assert_eq!(ExpertEngine::MlpCuda.label(), "cuda");
        assert!(ExpertEngine::StandinCpu.uses_onnx_runtime() && !ExpertEngine::MlpCpu.uses_onnx_runtime());
    }
}
