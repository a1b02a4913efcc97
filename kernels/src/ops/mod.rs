//! Ops: each has a CPU reference implementation; some also run on CUDA.
//!
//! Free functions (`matmul`, `gelu`, `moe_ffn_forward`, ...) are the CPU references. The [`Op`]
//! trait (candle's `CustomOp` pattern) puts an op behind one call that dispatches on [`Device`]:
//! `cpu` is required, `cuda` defaults to [`KernelError::Unsupported`].

mod attention;
mod elementwise;
mod gemm;
mod layer_norm;
mod loss;
pub(crate) mod moe;
mod optim;
mod routing;
mod softmax;

#[cfg(test)]
pub(crate) mod gradcheck;

pub use attention::{
    Attention, AttentionBackward, AttentionCache, AttentionGrads, AttentionParams, attention_backward,
    attention_backward_bytes, attention_forward, attention_saved_bytes, attention_tmp_bytes,
};
#[cfg(feature = "cuda")]
pub(crate) use attention::{
    dims as attention_dims, from_heads as attention_from_heads, to_heads as attention_to_heads,
};
pub use elementwise::{
    BiasAdd, BiasGrad, Gelu, GeluBackward, Relu, bias_add, bias_grad, erf, gelu, gelu_backward,
    gelu_grad_scalar, gelu_scalar, relu,
};
pub use gemm::{Gemm, Matmul, matmul};
#[cfg(feature = "cuda")]
pub(crate) use layer_norm::checked_dims as layer_norm_dims;
pub use layer_norm::{
    LayerNorm, LayerNormBackward, LayerNormCache, LayerNormGrads, layer_norm, layer_norm_backward,
};
#[cfg(feature = "cuda")]
pub(crate) use loss::checked_dims as cross_entropy_dims;
pub use loss::{CrossEntropy, cross_entropy};
pub use moe::{
    ExpertCache, ExpertGrads, ExpertParams, ExpertThreadPlanner, MoeCache, MoeFfn, MoeFfnBackward, MoeGrads,
    moe_ffn_backward, moe_ffn_forward, with_expert_threads,
};
pub use optim::{AdamW, Sgd};
pub use routing::{Assignment, Dropped, Routing, TopKRouting, top_k_route};
pub use softmax::{Softmax, softmax, softmax_backward};

use crate::cuda::CudaDevice;
use crate::device::Device;
use crate::error::{KernelError, Result};

/// An op with a CPU reference and an optional CUDA implementation.
pub trait Op {
    /// What the op reads (borrowed tensors and the like).
    type Args<'a>;
    /// What the op returns.
    type Output;
    /// The op's name for errors and logs.
    const NAME: &'static str;

    /// The CPU reference implementation.
    fn cpu(&self, args: Self::Args<'_>) -> Result<Self::Output>;

    /// The CUDA implementation; unsupported unless the op provides one.
    fn cuda(&self, dev: &CudaDevice, args: Self::Args<'_>) -> Result<Self::Output> {
        let _ = args;
        Err(KernelError::Unsupported { op: Self::NAME, device: format!("cuda:{}", dev.ordinal()) })
    }

    /// Run on `device`.
    fn run(&self, device: &Device, args: Self::Args<'_>) -> Result<Self::Output> {
        match device {
            Device::Cpu => self.cpu(args),
            Device::Cuda(d) => self.cuda(d, args),
        }
    }
}

/// `(rows, cols)` of a rank-2 tensor, or a shape error naming `op`.
pub(crate) fn rows_cols(op: &'static str, t: &crate::Tensor) -> Result<(usize, usize)> {
    t.dims2().map_err(|_| KernelError::shape(op, format!("expected a matrix, got {:?}", t.shape())))
}
