//! The MLP expert engine: runs an MLP that [`onnx::writer::mlp_model`](crate::onnx::writer::mlp_model)
//! wrote without ONNX Runtime, on any [`Device`]: per layer a GEMM, the bias add and ReLU, then
//! the softmax (or logits), through the kernels' own ops. On [`Device::Cpu`] those are the CPU
//! references (GEMM through `matrixmultiply`); on [`Device::Cuda`] the weights are uploaded once
//! and stay on the GPU, and a batch is cuBLAS GEMMs plus NVRTC kernels
//! ([`crate::cuda::mlp_forward_device`]).
//!
//! It exists because ONNX Runtime's CUDA provider is far larger than what a GPU machine can be
//! sent, while an expert is only dense + bias + ReLU layers. [`crate::onnx::mlp_graph`] refuses
//! every other graph, so the engine never computes something ONNX Runtime would not.

use crate::cuda::{CudaDense, CudaDevice, mlp_forward_device};
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::onnx::mlp_graph::{MlpGraph, MlpGraphError, MlpLimits, parse_mlp};
use crate::onnx::writer::DenseLayer;
use crate::ops::{BiasAdd, Matmul, Op, Relu, Softmax};
use crate::tensor::Tensor;

/// Why an engine could not be built: the model is not an MLP it runs, or the device failed.
#[derive(Debug, thiserror::Error)]
pub enum MlpEngineError {
    /// The ONNX model was refused.
    #[error("{0}")]
    Graph(#[from] MlpGraphError),
    /// Uploading the weights or running failed.
    #[error("{0}")]
    Kernel(#[from] KernelError),
}

/// One layer on the host: `w` `[inputs, outputs]`, `b` `[outputs]`, ReLU after it or not.
struct CpuDense {
    w: Tensor,
    b: Tensor,
    relu: bool,
}

/// The layers where the engine runs.
enum Layers {
    /// Host tensors, run by the CPU reference ops.
    Cpu(Vec<CpuDense>),
    /// Device buffers on this GPU.
    Cuda(CudaDevice, Vec<CudaDense>),
}

/// An MLP resident on a device (see the module docs).
pub struct MlpEngine {
    device: Device,
    layers: Layers,
    softmax: bool,
    inputs: usize,
    outputs: usize,
    weight_bytes: u64,
}

impl std::fmt::Debug for MlpEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlpEngine")
            .field("device", &self.device.name())
            .field("layers", &self.depth())
            .field("softmax", &self.softmax)
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish()
    }
}

impl MlpEngine {
    /// Parse the ONNX `bytes` (under `limits`) and put the weights on `device`.
    pub fn from_onnx(
        bytes: &[u8],
        limits: &MlpLimits,
        device: &Device,
    ) -> std::result::Result<Self, MlpEngineError> {
        let graph = parse_mlp(bytes, limits)?;
        Ok(Self::new(&graph, device)?)
    }

    /// Put `graph`'s weights on `device`.
    pub fn new(graph: &MlpGraph, device: &Device) -> Result<Self> {
        let (first, last) = match (graph.layers.first(), graph.layers.last()) {
            (Some(f), Some(l)) => (f, l),
            _ => return Err(KernelError::invalid("MlpEngine", "an MLP needs at least one layer")),
        };
        let n = graph.layers.len();
        let relu = |i: usize| i + 1 < n;
        let weight_bytes = graph.layers.iter().map(DenseLayer::param_bytes).sum();
        let layers = match device {
            Device::Cpu => Layers::Cpu(
                graph
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(i, l)| {
                        Ok(CpuDense {
                            w: Tensor::from_f32(&[l.inputs, l.outputs], l.weights.clone())?,
                            b: Tensor::from_f32(&[l.outputs], l.bias.clone())?,
                            relu: relu(i),
                        })
                    })
                    .collect::<Result<_>>()?,
            ),
            Device::Cuda(d) => Layers::Cuda(
                d.clone(),
                graph
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(i, l)| CudaDense::upload(d, l.inputs, l.outputs, &l.weights, &l.bias, relu(i)))
                    .collect::<Result<_>>()?,
            ),
        };
        Ok(Self {
            device: device.clone(),
            layers,
            softmax: graph.softmax,
            inputs: first.inputs,
            outputs: last.outputs,
            weight_bytes,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Number of dense layers.
    pub fn depth(&self) -> usize {
        match &self.layers {
            Layers::Cpu(l) => l.len(),
            Layers::Cuda(_, l) => l.len(),
        }
    }

    /// Input width.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Output width.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// Bytes of weights and biases held on the device (f32).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Run a batch: `x` is `[batch, inputs]` row-major; returns `[batch, outputs]`.
    pub fn run(&self, x: &[f32], batch: usize) -> Result<Vec<f32>> {
        if batch.checked_mul(self.inputs) != Some(x.len()) {
            return Err(KernelError::shape(
                "MlpEngine::run",
                format!("{} inputs for a batch of {batch} rows of {}", x.len(), self.inputs),
            ));
        }
        match &self.layers {
            Layers::Cpu(layers) => self.run_cpu(layers, x, batch),
            Layers::Cuda(d, layers) => mlp_forward_device(d, layers, self.softmax, x, batch),
        }
    }

    fn run_cpu(&self, layers: &[CpuDense], x: &[f32], batch: usize) -> Result<Vec<f32>> {
        let mut cur = Tensor::from_f32(&[batch, self.inputs], x.to_vec())?;
        for l in layers {
            cur = BiasAdd.cpu((&Matmul::default().cpu((&cur, &l.w))?, &l.b))?;
            if l.relu {
                cur = Relu.cpu(&cur)?;
            }
        }
        if self.softmax {
            cur = Softmax.cpu(&cur)?;
        }
        Ok(cur.to_vec_f32())
    }
}
