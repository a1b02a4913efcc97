//! An MLP expert's forward pass on the GPU: per layer a cuBLAS GEMM, the row bias add and ReLU
//! between layers, an optional row softmax at the end. Weights stay resident on the device
//! ([`CudaDense`]); a batch costs one upload of the inputs and one download of the outputs.

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView};

use super::CudaDevice;
use super::DenseAt;
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
    let views = layers.iter().map(|l| (l.inputs, l.outputs, l.w.as_view(), l.b.as_view(), l.relu)).collect();
    forward(dev, views, softmax, x, batch)
}

/// One layer as the forward pass reads it: widths, weights, biases, ReLU after it.
type LayerView<'a> = (usize, usize, CudaView<'a, f32>, CudaView<'a, f32>, bool);

/// The forward pass over `layers` (see [`mlp_forward_device`]).
fn forward(
    dev: &CudaDevice,
    layers: Vec<LayerView<'_>>,
    softmax: bool,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f32>> {
    let first = layers.first().ok_or_else(|| KernelError::invalid("mlp forward", "no layers"))?;
    if batch.checked_mul(first.0) != Some(x.len()) {
        return Err(KernelError::shape(
            "mlp forward",
            format!("{} inputs for a batch of {batch} rows of {}", x.len(), first.0),
        ));
    }
    let mut cur = dev.upload(x)?;
    let mut width = first.0;
    for (inputs, outputs, w, b, relu) in &layers {
        if *inputs != width {
            return Err(KernelError::shape(
                "mlp forward",
                format!("layer takes {inputs} inputs, previous gives {width}"),
            ));
        }
        let g = Gemm::new(batch, *inputs, *outputs);
        let mut y = dev.zeros(batch * outputs)?;
        gemm_device(dev, &g, &cur, w, &mut y)?;
        bias_add_rows_device(dev, &mut y, b, batch, *outputs)?;
        if *relu {
            relu_device(dev, &mut y)?;
        }
        cur = y;
        width = *outputs;
    }
    if softmax {
        softmax_rows_device(dev, &mut cur, batch, width)?;
    }
    dev.download(&cur)
}

/// [`mlp_forward_device`] with the parameters read in place from `arena[base..base + len]`
/// (see [`DenseAt`]): no copy of the weights exists besides the arena's.
#[allow(clippy::too_many_arguments)]
pub fn mlp_forward_arena(
    dev: &CudaDevice,
    arena: &CudaSlice<u8>,
    base: usize,
    len: usize,
    layers: &[DenseAt],
    softmax: bool,
    x: &[f32],
    batch: usize,
) -> Result<Vec<f32>> {
    if base.checked_add(len).is_none_or(|end| end > arena.len()) {
        return Err(KernelError::invalid(
            "mlp in arena",
            format!("allocation {base}+{len} outside an arena of {} bytes", arena.len()),
        ));
    }
    let blob = arena.slice(base..base + len);
    let floats = |r: &Range<usize>| -> Result<CudaView<'_, f32>> {
        // SAFETY: `DenseAt::check` proved the range lies in the allocation, starts 4-byte
        // aligned and holds exactly `len / 4` f32s, which any bit pattern is.
        unsafe { blob.slice(r.clone()).transmute::<f32>(r.len() / 4) }
            .ok_or_else(|| KernelError::invalid("mlp in arena", format!("range {r:?} too short")))
    };
    let views = layers
        .iter()
        .map(|l| {
            l.check(base, len)?;
            Ok((l.inputs, l.outputs, floats(&l.weights)?, floats(&l.bias)?, l.relu))
        })
        .collect::<Result<_>>()?;
    forward(dev, views, softmax, x, batch)
}
