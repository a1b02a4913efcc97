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

use crate::cuda::{CudaDense, CudaDevice, CudaSlice, DenseAt, mlp_forward_arena, mlp_forward_device};
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::onnx::mlp_graph::{MlpGraph, MlpGraphError, MlpLimits, parse_mlp};
use crate::onnx::writer::DenseLayer;
use crate::ops::{BiasAdd, Gemm, Op, Relu, Softmax};
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
        let params = layers.iter().map(|l| Ok((l.w.as_f32()?, l.b.as_f32()?, l.relu)));
        forward_cpu(params, self.softmax, x, (batch, self.inputs))
    }
}

/// One layer for [`forward_cpu`]: weights (`[inputs, outputs]` row-major), biases, ReLU after.
type CpuLayer<'a> = (&'a [f32], &'a [f32], bool);

/// `x` (`[batch, inputs]`) through dense layers on the CPU reference ops (GEMM, bias add,
/// ReLU), then a row softmax when `softmax`; each layer's width comes from its bias (the GEMM
/// checks the weights against it).
fn forward_cpu<'a>(
    layers: impl Iterator<Item = Result<CpuLayer<'a>>>,
    softmax: bool,
    x: &[f32],
    (batch, inputs): (usize, usize),
) -> Result<Vec<f32>> {
    let mut cur = x.to_vec();
    let mut width = inputs;
    for layer in layers {
        let (w, b, relu) = layer?;
        let outputs = b.len();
        let mut y = vec![0f32; batch * outputs];
        Gemm::new(batch, width, outputs).run_cpu(&cur, w, &mut y)?;
        let mut t = BiasAdd
            .cpu((&Tensor::from_f32(&[batch, outputs], y)?, &Tensor::from_f32(&[outputs], b.to_vec())?))?;
        if relu {
            t = Relu.cpu(&t)?;
        }
        cur = t.to_vec_f32();
        width = outputs;
    }
    if softmax {
        cur = Softmax.cpu(&Tensor::from_f32(&[batch, width], cur)?)?.to_vec_f32();
    }
    Ok(cur)
}

/// An MLP run where its ONNX file's bytes lie (a weight-store arena allocation, in GPU or host
/// memory): only the layout is kept, so the arena's copy, the one the pool accounts, is the only
/// copy of the weights. Built only when every parameter is aligned inline `raw_data`, as
/// [`mlp_model`](crate::onnx::writer::mlp_model) writes it; other files need [`MlpEngine`].
#[derive(Clone, Debug, PartialEq)]
pub struct ArenaMlp {
    layers: Vec<DenseAt>,
    softmax: bool,
    inputs: usize,
    outputs: usize,
    len: usize,
}

impl ArenaMlp {
    /// The layout of the ONNX `bytes` (parsed under `limits`); `Ok(None)` when its parameters
    /// cannot be read in place (not inline, or not 4-byte aligned).
    pub fn from_onnx(bytes: &[u8], limits: &MlpLimits) -> std::result::Result<Option<Self>, MlpEngineError> {
        let graph = parse_mlp(bytes, limits)?;
        let Some(ranges) = graph.ranges else { return Ok(None) };
        let n = graph.layers.len();
        let layers: Vec<DenseAt> = graph
            .layers
            .iter()
            .zip(ranges)
            .enumerate()
            .map(|(i, (l, r))| DenseAt {
                inputs: l.inputs,
                outputs: l.outputs,
                weights: r.weights,
                bias: r.bias,
                relu: i + 1 < n,
            })
            .collect();
        let (inputs, outputs) = match (layers.first(), layers.last()) {
            (Some(f), Some(l)) => (f.inputs, l.outputs),
            _ => return Err(KernelError::invalid("ArenaMlp", "an MLP needs at least one layer").into()),
        };
        Ok(Some(Self { layers, softmax: graph.softmax, inputs, outputs, len: bytes.len() }))
    }

    /// Bytes of the file the layout was read from (what the allocation must hold).
    pub fn file_len(&self) -> usize {
        self.len
    }

    /// Input width.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Output width.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// Run a batch (`x` `[batch, inputs]`) with the parameters read from `file`, the model's
    /// bytes in host memory; the CPU reference ops compute it.
    pub fn run_host(&self, file: &[u8], x: &[f32], batch: usize) -> Result<Vec<f32>> {
        if file.len() != self.len {
            return Err(KernelError::invalid(
                "ArenaMlp",
                format!("{} bytes, the model has {}", file.len(), self.len),
            ));
        }
        if batch.checked_mul(self.inputs) != Some(x.len()) {
            return Err(KernelError::shape(
                "ArenaMlp::run_host",
                format!("{} inputs for a batch of {batch} rows of {}", x.len(), self.inputs),
            ));
        }
        let floats = |r: &std::ops::Range<usize>| -> Result<&[f32]> {
            // SAFETY: every bit pattern is a valid f32; `align_to` only yields the aligned middle.
            let (pre, mid, post) = unsafe { file[r.clone()].align_to::<f32>() };
            if pre.is_empty() && post.is_empty() {
                Ok(mid)
            } else {
                Err(KernelError::invalid(
                    "ArenaMlp",
                    format!("parameters at {r:?} are not 4-byte aligned in memory"),
                ))
            }
        };
        let params = self.layers.iter().map(|l| {
            l.check(file.as_ptr() as usize, file.len())?;
            Ok((floats(&l.weights)?, floats(&l.bias)?, l.relu))
        });
        forward_cpu(params, self.softmax, x, (batch, self.inputs))
    }

    /// Run a batch on the GPU with the parameters read in place from `arena[base..]` (the
    /// allocation holding the model's bytes).
    pub fn run_cuda(
        &self,
        dev: &CudaDevice,
        arena: &CudaSlice<u8>,
        base: usize,
        x: &[f32],
        batch: usize,
    ) -> Result<Vec<f32>> {
        mlp_forward_arena(dev, arena, base, self.len, &self.layers, self.softmax, x, batch)
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::onnx::proto::ModelProto;
    use crate::onnx::writer::{mlp_model, tests::layer};

    #[test]
    fn in_place_run_equals_the_engine_with_its_own_copy() {
        let layers = vec![layer(16, 24, 1), layer(24, 8, 2), layer(8, 5, 3)];
        let bytes = mlp_model(&layers, "x", "y").unwrap();
        let own = MlpEngine::from_onnx(&bytes, &MlpLimits::default(), &Device::Cpu).unwrap();
        let arena = ArenaMlp::from_onnx(&bytes, &MlpLimits::default()).unwrap().expect("the writer aligns");
        assert_eq!((arena.inputs(), arena.outputs(), arena.file_len()), (16, 5, bytes.len()));
        let x: Vec<f32> = (0..3 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        // The file at a 4-byte aligned address, as an arena allocation is.
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        let file = &mut bytemuck_bytes(&mut words)[..bytes.len()];
        file.copy_from_slice(&bytes);
        assert_eq!(arena.run_host(file, &x, 3).unwrap(), own.run(&x, 3).unwrap());
        // A wrong length or batch is refused, not read past.
        assert!(arena.run_host(&file[..bytes.len() - 1], &x, 3).is_err());
        assert!(arena.run_host(file, &x[..47], 3).is_err());
    }

    #[test]
    fn a_file_whose_parameters_are_not_aligned_needs_its_own_copy() {
        let bytes = mlp_model(&[layer(4, 3, 1)], "x", "y").unwrap();
        let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
        // One more byte in the graph's name shifts every initializer off its alignment.
        m.graph.as_mut().unwrap().name.as_mut().unwrap().push('!');
        let shifted = m.encode_to_vec();
        assert_eq!(ArenaMlp::from_onnx(&shifted, &MlpLimits::default()).unwrap(), None);
        assert!(MlpEngine::from_onnx(&shifted, &MlpLimits::default(), &Device::Cpu).is_ok());
    }

    /// `words` as bytes (4-byte aligned).
    fn bytemuck_bytes(words: &mut [u32]) -> &mut [u8] {
        // SAFETY: u8 has no alignment or validity requirement; the length covers the words.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4) }
    }
}
