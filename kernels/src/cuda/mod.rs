//! CUDA backend: device handle and probing, cuBLAS GEMM, elementwise kernels (bias, ReLU,
//! softmax), the MoE expert FFN and the MLP experts' forward pass on the GPU.
//!
//! Everything goes through cudarc with dynamic loading, so the crate builds and runs without a GPU;
//! device-side code is CUDA C compiled at run time by NVRTC (no nvcc at build time).
//!
//! Built without the `cuda` feature (no cudarc at all) the same names exist, but a
//! [`CudaDevice`] cannot be made: opening one is [`crate::KernelError::CudaUnavailable`] saying
//! the crate was built without the `cuda` feature, so [`crate::Device::best`] is the CPU.

mod dense_at;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod mlp;
#[cfg(feature = "cuda")]
mod moe;
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(feature = "cuda")]
mod vmoe;
#[cfg(feature = "cuda")]
mod vmoe_src;

/// A device buffer (cudarc's), as the weight store's arena and the MLP layers hold them.
#[cfg(feature = "cuda")]
pub use cudarc::driver::CudaSlice;
pub use dense_at::DenseAt;
#[cfg(feature = "cuda")]
pub use device::{CudaDevice, cuda_available, driver_library_present, ffn_kernels_ptx};
#[cfg(feature = "cuda")]
pub use elementwise::{bias_add, bias_add_rows_device, relu, relu_device, softmax, softmax_rows_device};
#[cfg(feature = "cuda")]
pub use gemm::{gemm_device, matmul};
#[cfg(feature = "cuda")]
pub use mlp::{CudaDense, mlp_forward_arena, mlp_forward_device};
#[cfg(feature = "cuda")]
pub use moe::{moe_ffn_backward, moe_ffn_forward};
#[cfg(not(feature = "cuda"))]
pub use stub::{
    CudaAdamW, CudaDense, CudaDevice, CudaSlice, NOT_BUILT, attention_backward, attention_forward, bias_add,
    bias_grad, cross_entropy, cuda_available, driver_library_present, ffn_kernels_ptx, gelu, gelu_backward,
    layer_norm, layer_norm_backward, matmul, mlp_forward_arena, mlp_forward_device, moe_ffn_backward,
    moe_ffn_forward, relu, softmax, vmoe_kernels_ptx,
};
#[cfg(feature = "cuda")]
pub use vmoe::{
    CudaAdamW, attention_backward, attention_forward, bias_grad, cross_entropy, gelu, gelu_backward,
    layer_norm, layer_norm_backward, vmoe_kernels_ptx,
};
