//! CUDA backend: device handle and probing, cuBLAS GEMM, the MoE expert FFN on the GPU.
//!
//! Everything goes through cudarc with dynamic loading, so the crate builds and runs without a GPU;
//! device-side code is CUDA C compiled at run time by NVRTC (no nvcc at build time).

mod device;
mod gemm;
mod kernels;
mod moe;

pub use device::{CudaDevice, cuda_available, driver_library_present, ffn_kernels_ptx};
pub use gemm::{gemm_device, matmul};
pub use moe::{moe_ffn_backward, moe_ffn_forward};
