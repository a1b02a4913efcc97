//! CUDA backend: device handle and probing, cuBLAS GEMM, elementwise kernels (bias, ReLU,
//! softmax), the MoE expert FFN and the MLP experts' forward pass on the GPU.
//!
//! Everything goes through cudarc with dynamic loading, so the crate builds and runs without a GPU;
//! device-side code is CUDA C compiled at run time by NVRTC (no nvcc at build time).

mod device;
mod elementwise;
mod gemm;
mod kernels;
mod mlp;
mod moe;

pub use device::{CudaDevice, cuda_available, driver_library_present, ffn_kernels_ptx};
pub use elementwise::{bias_add, bias_add_rows_device, relu, relu_device, softmax, softmax_rows_device};
pub use gemm::{gemm_device, matmul};
pub use mlp::{CudaDense, DenseAt, mlp_forward_arena, mlp_forward_device};
pub use moe::{moe_ffn_backward, moe_ffn_forward};
