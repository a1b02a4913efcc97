//! An MLP expert's forward pass on the GPU: per layer a cuBLAS GEMM, the row bias add and ReLU
//! between layers, an optional row softmax at the end. Weights stay resident on the device
//! ([`CudaDense`]); a batch costs one upload of the inputs and one download of the outputs.

use cudarc::driver::CudaSlice;

use super::CudaDevice;
use super::elementwise::{bias_add_rows_device, relu_device, softmax_rows_device};
use super::gemm::gemm_device;
use crate::error::{KernelError, Result};
use crate::ops::Gemm;

/// One dense layer's weights on the device: `w` row-major `[inputs, outputs]`, `b` `[outputs]`.
pub struct CudaDense {
    /// Input width.
    pub inputs: usize,
    /// Output width.
    pub outputs: usize,
    /// `inputs * outputs` weights.
    pub w: CudaSlice<f32>,
    /// `outputs` biases.
    pub b: CudaSlice<f32>,
    /// Whether ReLU follows this layer.
    pub relu: bool,
}

impl CudaDense {
    /// Upload one layer (`weights` row-major `[inputs, outputs]`).
    pub fn upload(
        dev: &CudaDevice,
        inputs: usize,
        outputs: usize,
        weights: &[f32],
        bias: &[f32],
        relu: bool,
    ) -> Result<Self> {
        if inputs.checked_mul(outputs) != Some(weights.len()) || bias.len() != outputs {
            return Err(KernelError::shape(
                "mlp layer upload",
                format!("{} weights and {} biases for {inputs} x {outputs}", weights.len(), bias.len()),
            ));
        }
        Ok(Self { inputs, outputs, w: dev.upload(weights)?, b: dev.upload(bias)?, relu })
    }
}

/// `x` (`[batch, layers[0].inputs]` row-major) through `layers` on `dev`, then a row softmax
/// when `softmax`; returns `[batch, last outputs]` on the host.
pub fn mlp_forward_device(
    dev: &CudaDevice,
    layers: &[CudaDense],
    softmax: bool,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f32>> {
    let first = layers.first().ok_or_else(|| KernelError::invalid("mlp forward", "no layers"))?;
    if batch.checked_mul(first.inputs) != Some(x.len()) {
        return Err(KernelError::shape(
            "mlp forward",
            format!("{} inputs for a batch of {batch} rows of {}", x.len(), first.inputs),
        ));
    }
    let mut cur = dev.upload(x)?;
    let mut width = first.inputs;
    for l in layers {
        if l.inputs != width {
            return Err(KernelError::shape(
                "mlp forward",
                format!("layer takes {} inputs, previous gives {width}", l.inputs),
            ));
        }
        let g = Gemm::new(batch, l.inputs, l.outputs);
        let mut y = dev.zeros(batch * l.outputs)?;
        gemm_device(dev, &g, &cur, &l.w, &mut y)?;
        bias_add_rows_device(dev, &mut y, &l.b, batch, l.outputs)?;
        if l.relu {
            relu_device(dev, &mut y)?;
        }
        cur = y;
        width = l.outputs;
    }
    if softmax {
        softmax_rows_device(dev, &mut cur, batch, width)?;
    }
    dev.download(&cur)
}
