//! The CUDA backend of a build without the `cuda` feature: the same names as the real one, no
//! cudarc. [`CudaDevice`] and [`CudaSlice`] have no values (opening a device is an error naming
//! the missing feature), so every function taking one is statically unreachable.

use std::marker::PhantomData;

use crate::error::{KernelError, Result};
use crate::ops::{
    AdamW, AttentionCache, AttentionGrads, AttentionParams, ExpertParams, LayerNormCache, LayerNormGrads,
    MoeCache, MoeGrads, Routing,
};
use crate::tensor::Tensor;

/// Why CUDA is unavailable in this build (the reason in [`KernelError::CudaUnavailable`]).
pub const NOT_BUILT: &str = "troupe-kernels was built without the `cuda` feature";

/// No value: stands for what a CUDA build would hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Never {}

fn not_built() -> KernelError {
    KernelError::CudaUnavailable(NOT_BUILT.to_string())
}

/// A CUDA GPU; in this build there is none (see [`CudaDevice::new`]).
#[derive(Clone, Debug)]
pub struct CudaDevice(Never);

/// A device buffer; in this build there is none.
#[derive(Debug)]
pub struct CudaSlice<T>(Never, PhantomData<T>);

impl<T> CudaSlice<T> {
    /// Its length in elements.
    pub fn len(&self) -> usize {
        match self.0 {}
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
}

/// Always `false`: this build never loads a CUDA driver library.
pub fn driver_library_present() -> bool {
    false
}

/// Always [`KernelError::CudaUnavailable`] ([`NOT_BUILT`]).
pub fn cuda_available(_ordinal: usize) -> Result<()> {
    Err(not_built())
}

/// Always [`KernelError::CudaUnavailable`] ([`NOT_BUILT`]): there is no NVRTC in this build.
pub fn ffn_kernels_ptx() -> Result<String> {
    Err(not_built())
}

impl CudaDevice {
    /// Always [`KernelError::CudaUnavailable`] ([`NOT_BUILT`]).
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(not_built())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.0 {}
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        match self.0 {}
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        match self.0 {}
    }

    /// Block until all queued work has finished.
    pub fn sync(&self) -> Result<()> {
        match self.0 {}
    }

    /// Copy host f32s to a new device buffer.
    pub fn upload(&self, _data: &[f32]) -> Result<CudaSlice<f32>> {
        match self.0 {}
    }

    /// A zeroed device buffer of `len` f32s.
    pub fn zeros(&self, _len: usize) -> Result<CudaSlice<f32>> {
        match self.0 {}
    }

    /// Copy a device buffer back to the host.
    pub fn download(&self, _data: &CudaSlice<f32>) -> Result<Vec<f32>> {
        match self.0 {}
    }

    /// A zeroed device buffer of `len` bytes.
    pub fn alloc_bytes(&self, _len: usize) -> Result<CudaSlice<u8>> {
        match self.0 {}
    }

    /// Copy `data` into `buf` at `offset`.
    pub fn write_bytes(&self, _buf: &mut CudaSlice<u8>, _offset: usize, _data: &[u8]) -> Result<()> {
        match self.0 {}
    }

    /// Copy `len` bytes at `offset` of `buf` back to the host.
    pub fn read_bytes(&self, _buf: &CudaSlice<u8>, _offset: usize, _len: usize) -> Result<Vec<u8>> {
        match self.0 {}
    }

    /// Copy `dst.len()` bytes at `offset` of `buf` into `dst`.
    pub fn read_bytes_into(&self, _buf: &CudaSlice<u8>, _offset: usize, _dst: &mut [u8]) -> Result<()> {
        match self.0 {}
    }
}

/// `x + bias` per row on the GPU.
pub fn bias_add(dev: &CudaDevice, _x: &Tensor, _bias: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// ReLU on the GPU.
pub fn relu(dev: &CudaDevice, _x: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// Row softmax on the GPU.
pub fn softmax(dev: &CudaDevice, _x: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// Matrix product on the GPU.
pub fn matmul(dev: &CudaDevice, _a: &Tensor, _b: &Tensor, _trans_a: bool, _trans_b: bool) -> Result<Tensor> {
    match dev.0 {}
}

/// MoE FFN forward on the GPU.
pub fn moe_ffn_forward(
    dev: &CudaDevice,
    _x: &Tensor,
    _routing: &Routing,
    _experts: &[ExpertParams],
) -> Result<(Tensor, MoeCache)> {
    match dev.0 {}
}

/// MoE FFN backward on the GPU.
pub fn moe_ffn_backward(
    dev: &CudaDevice,
    _dy: &Tensor,
    _cache: &MoeCache,
    _experts: &[ExpertParams],
) -> Result<MoeGrads> {
    match dev.0 {}
}

/// Always [`KernelError::CudaUnavailable`] ([`NOT_BUILT`]): there is no NVRTC in this build.
pub fn vmoe_kernels_ptx() -> Result<String> {
    Err(not_built())
}

/// Layer norm forward on the GPU.
pub fn layer_norm(
    dev: &CudaDevice,
    _x: &Tensor,
    _gamma: &Tensor,
    _beta: &Tensor,
    _eps: f32,
) -> Result<(Tensor, LayerNormCache)> {
    match dev.0 {}
}

/// Layer norm backward on the GPU.
pub fn layer_norm_backward(
    dev: &CudaDevice,
    _dy: &Tensor,
    _gamma: &Tensor,
    _cache: &LayerNormCache,
) -> Result<LayerNormGrads> {
    match dev.0 {}
}

/// The bias gradient on the GPU.
pub fn bias_grad(dev: &CudaDevice, _dy: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// GELU on the GPU.
pub fn gelu(dev: &CudaDevice, _x: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// GELU backward on the GPU.
pub fn gelu_backward(dev: &CudaDevice, _x: &Tensor, _dy: &Tensor) -> Result<Tensor> {
    match dev.0 {}
}

/// Cross-entropy on the GPU.
pub fn cross_entropy(dev: &CudaDevice, _logits: &Tensor, _targets: &[usize]) -> Result<(f32, Tensor)> {
    match dev.0 {}
}

/// Attention forward on the GPU.
pub fn attention_forward(
    dev: &CudaDevice,
    _x: &Tensor,
    _p: &AttentionParams,
    _seq_len: usize,
    _heads: usize,
) -> Result<(Tensor, AttentionCache)> {
    match dev.0 {}
}

/// Attention backward on the GPU.
pub fn attention_backward(
    dev: &CudaDevice,
    _dy: &Tensor,
    _p: &AttentionParams,
    _cache: &AttentionCache,
) -> Result<AttentionGrads> {
    match dev.0 {}
}

/// AdamW with its moments on the device; in this build there is none.
#[derive(Clone, Debug)]
pub struct CudaAdamW {
    /// The hyper-parameters.
    pub hyper: AdamW,
    never: Never,
}

impl CudaAdamW {
    /// Moments for `len` parameters on the device.
    pub fn new(dev: &CudaDevice, _hyper: AdamW, _len: usize) -> Result<Self> {
        match dev.0 {}
    }

    /// Bytes the moments hold on the device.
    pub fn state_bytes(&self) -> u64 {
        match self.never {}
    }

    /// One step of device `params` with device `grads`.
    pub fn step_device(
        &mut self,
        _dev: &CudaDevice,
        _params: &mut CudaSlice<f32>,
        _grads: &CudaSlice<f32>,
    ) -> Result<()> {
        match self.never {}
    }

    /// One step of host `params` with host `grads`.
    pub fn step(&mut self, _dev: &CudaDevice, _params: &mut [f32], _grads: &[f32]) -> Result<()> {
        match self.never {}
    }
}

/// One dense layer's weights on the device.
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
        _inputs: usize,
        _outputs: usize,
        _weights: &[f32],
        _bias: &[f32],
        _relu: bool,
    ) -> Result<Self> {
        match dev.0 {}
    }
}

/// An MLP's forward pass on the GPU.
pub fn mlp_forward_device(
    dev: &CudaDevice,
    _layers: &[CudaDense],
    _softmax: bool,
    _x: &[f32],
    _batch: usize,
) -> Result<Vec<f32>> {
    match dev.0 {}
}

/// An MLP's forward pass on the GPU with its parameters in a device arena.
#[allow(clippy::too_many_arguments)]
pub fn mlp_forward_arena(
    dev: &CudaDevice,
    _arena: &CudaSlice<u8>,
    _base: usize,
    _len: usize,
    _layers: &[super::DenseAt],
    _softmax: bool,
    _x: &[f32],
    _batch: usize,
) -> Result<Vec<f32>> {
    match dev.0 {}
}

#[cfg(test)]
mod tests {
    use super::NOT_BUILT;
    use crate::{Device, KernelError};

    #[test]
    fn asking_for_cuda_names_the_missing_feature() {
        for r in [Device::cuda(0).map(|_| ()), Device::from_name("cuda:1").map(|_| ())] {
            match r {
                Err(KernelError::CudaUnavailable(reason)) => assert_eq!(reason, NOT_BUILT),
                other => panic!("expected CudaUnavailable, got {other:?}"),
            }
        }
        assert!(NOT_BUILT.contains("`cuda` feature"), "{NOT_BUILT}");
        assert_eq!(Device::best().name(), "cpu");
    }
}
