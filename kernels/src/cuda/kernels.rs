//! CUDA C for the elementwise parts of the expert FFN and of the MLP experts (bias add, ReLU,
//! row softmax), compiled at run time by NVRTC. GELU is the exact erf form, matching the CPU
//! reference.

/// Cache key of the module below.
pub(crate) const MODULE: &str = "troupe_ffn_elementwise";

/// Kernel source.
pub(crate) const SRC: &str = r#"
extern "C" __global__ void bias_gelu_fwd(float* h, const float* bias, float* a, int total, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) {
        float v = h[i] + bias[i % cols];
        h[i] = v;
        a[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
}

extern "C" __global__ void bias_add_rows(float* y, const float* bias, int total, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) {
        y[i] += bias[i % cols];
    }
}

extern "C" __global__ void gelu_bwd_inplace(float* grad, const float* h, int total) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) {
        float x = h[i];
        float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
        grad[i] *= cdf + x * pdf;
    }
}

extern "C" __global__ void relu_inplace(float* y, int total) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) {
        y[i] = fmaxf(y[i], 0.0f);
    }
}

// One thread per row: the rows are an MLP's output widths (a few to a few hundred), the max is
// subtracted first and the sum is taken in double, as in the CPU reference.
extern "C" __global__ void softmax_rows(float* y, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        float* row = y + (long long)r * cols;
        float m = __int_as_float(0xff800000);  // -inf
        for (int j = 0; j < cols; ++j) m = fmaxf(m, row[j]);
        double sum = 0.0;
        for (int j = 0; j < cols; ++j) {
            double e = exp((double)(row[j] - m));
            row[j] = (float)e;
            sum += e;
        }
        for (int j = 0; j < cols; ++j) row[j] = (float)((double)row[j] / sum);
    }
}
"#;
