//! troupe's compute: tensors, devices (CPU, CUDA), ops with backward passes, memory pools and the
//! tiered weight store, the ONNX executor and the assets made by `scripts/setup`.
//!
//! - [`Tensor`]: shape over an `Arc`'d f32 / bf16 buffer; views cost nothing.
//! - [`Device`]: `Cpu` or `Cuda`; CUDA is detected at run time and its absence is an error, never a panic.
//! - [`ops`]: CPU references for every op (GEMM through `matrixmultiply`), CUDA versions of GEMM,
//!   bias add, ReLU, softmax and the MoE expert FFN, finite-difference-checked backward passes, SGD and AdamW.
//! - [`MemoryPool`]: a budgeted offset allocator with fragmentation figures.
//! - [`WeightStore`]: blobs across device / host / disk tiers, checksummed, read with `O_DIRECT`;
//!   [`slot_file`]: fixed-size slots in one file, rewritten in place (a cache's spill tier).
//! - [`mlp_engine`]: the writer's MLP experts run on the ops, on the CPU or the GPU (no ONNX Runtime).
//! - [`onnx`]: ONNX Runtime sessions (load-dynamic), MiniLM embeddings; [`tokenizer`]: BERT WordPiece.
//! - [`assets`]: models and data made by `scripts/setup`, checksummed; [`cpu_time`]: this thread's CPU clock.
//! - [`vmoe`]: a small Vision MoE on the ops (digits), its training, and the co-adaptation pool;
//!   [`drift`]: weather-like corruptions and per-camera drifting frame streams.
//!
//! Features (both default): `cuda` (cudarc; without it [`cuda`] is a stub whose devices cannot be
//! opened: `KernelError::CudaUnavailable` naming the feature) and `onnx` (ort and prost: the
//! `onnx`, `mlp` and `mlp_engine` modules exist only with it).

pub mod assets;
pub mod cpu_time;
pub mod cuda;
pub mod device;
pub mod direct_io;
pub mod drift;
pub mod error;
#[cfg(feature = "onnx")]
pub mod mlp;
#[cfg(feature = "onnx")]
pub mod mlp_engine;
#[cfg(feature = "onnx")]
pub mod onnx;
pub mod ops;
pub mod pool;
pub mod reclaimer;
pub mod slot_file;
pub mod spare_buffers;
pub mod store;
pub mod tensor;
pub mod tokenizer;
pub mod vmoe;

pub use cuda::CudaDevice;
pub use device::{Device, DeviceKind};
pub use error::{KernelError, Result};
pub use ops::Op;
pub use pool::{Allocation, MemoryPool, PoolStats};
pub use store::{BlobId, DeviceBytes, DeviceTraffic, StoreStats, Tier, Transfer, WeightStore};
pub use tensor::{DType, Tensor, bf16_to_f32, f32_to_bf16};
