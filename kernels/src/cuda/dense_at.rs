//! [`DenseAt`]: where one dense layer's parameters lie in a byte buffer. Plain ranges, no CUDA
//! call, so it exists with or without the `cuda` feature.

use std::ops::Range;

use crate::error::{KernelError, Result};

/// One dense layer whose parameters lie in a byte buffer (a weight-store arena allocation
/// holding the expert's ONNX file): `weights` (`[inputs, outputs]` row-major f32) and `bias`
/// (`[outputs]`) are byte ranges of that allocation, each starting at a multiple of 4.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseAt {
    /// Input width.
    pub inputs: usize,
    /// Output width.
    pub outputs: usize,
    /// Byte range of the weights in the allocation.
    pub weights: Range<usize>,
    /// Byte range of the biases in the allocation.
    pub bias: Range<usize>,
    /// Whether ReLU follows this layer.
    pub relu: bool,
}

impl DenseAt {
    /// Checks the ranges against an allocation of `len` bytes at `base` (alignment included).
    pub fn check(&self, base: usize, len: usize) -> Result<()> {
        for (what, r, floats) in
            [("weights", &self.weights, self.inputs * self.outputs), ("bias", &self.bias, self.outputs)]
        {
            if r.end > len || r.start > r.end || r.len() != 4 * floats || !(base + r.start).is_multiple_of(4)
            {
                return Err(KernelError::invalid(
                    "mlp in arena",
                    format!(
                        "{what} at {r:?} of an allocation of {len} bytes at {base} ({floats} aligned floats expected)"
                    ),
                ));
            }
        }
        Ok(())
    }
}
