//! CUDA C for the V-MoE's ops other than GEMM and the expert FFN: layer norm, GELU, column sums
//! (bias and layer-norm parameter gradients), cross-entropy, AdamW and multi-head attention's
//! per-head products, compiled at run time by NVRTC. Each kernel follows its CPU reference in
//! `ops/` (same formulas, f64 where the reference sums in f64) so the CUDA-vs-CPU tests compare
//! within float rounding.

/// Cache key of the module below.
pub(crate) const MODULE: &str = "troupe_vmoe_ops";

/// Kernel source.
pub(crate) const SRC: &str = r#"
// Layer norm forward, one thread per row (rows are tokens, columns the model width: <= 512).
extern "C" __global__ void ln_fwd(const float* x, const float* gamma, const float* beta, float* y,
                                  float* xhat, float* rstd, int rows, int cols, float eps) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = x + (long long)r * cols;
    double mean = 0.0;
    for (int c = 0; c < cols; ++c) mean += (double)row[c];
    mean /= (double)cols;
    double var = 0.0;
    for (int c = 0; c < cols; ++c) {
        double d = (double)row[c] - mean;
        var += d * d;
    }
    var /= (double)cols;
    double rs = 1.0 / sqrt(var + (double)eps);
    rstd[r] = (float)rs;
    for (int c = 0; c < cols; ++c) {
        long long i = (long long)r * cols + c;
        float h = (float)(((double)row[c] - mean) * rs);
        xhat[i] = h;
        y[i] = h * gamma[c] + beta[c];
    }
}

// Layer norm backward, input gradient: dx = rstd/N (N dxh - sum dxh - x_hat sum(dxh x_hat)),
// dxh = dy gamma. One thread per row.
extern "C" __global__ void ln_bwd_dx(const float* dy, const float* gamma, const float* xhat,
                                     const float* rstd, float* dx, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    long long base = (long long)r * cols;
    double s1 = 0.0, s2 = 0.0;
    for (int c = 0; c < cols; ++c) {
        double dxh = (double)dy[base + c] * (double)gamma[c];
        s1 += dxh;
        s2 += dxh * (double)xhat[base + c];
    }
    double rs = (double)rstd[r], n = (double)cols;
    for (int c = 0; c < cols; ++c) {
        double dxh = (double)dy[base + c] * (double)gamma[c];
        dx[base + c] = (float)(rs / n * (n * dxh - s1 - (double)xhat[base + c] * s2));
    }
}

// out[c] = sum over rows of a[r, c] (the bias gradient, layer norm's dbeta). One thread per column.
extern "C" __global__ void col_sum(const float* a, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    double acc = 0.0;
    for (int r = 0; r < rows; ++r) acc += (double)a[(long long)r * cols + c];
    out[c] = (float)acc;
}

// out[c] = sum over rows of a[r, c] * b[r, c] (layer norm's dgamma). One thread per column.
extern "C" __global__ void col_dot(const float* a, const float* b, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    double acc = 0.0;
    for (int r = 0; r < rows; ++r) {
        long long i = (long long)r * cols + c;
        acc += (double)a[i] * (double)b[i];
    }
    out[c] = (float)acc;
}

// GELU, exact erf form.
extern "C" __global__ void gelu_fwd(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
}

// dx = dy * GELU'(x) = dy * (Phi(x) + x phi(x)).
extern "C" __global__ void gelu_bwd(const float* x, const float* dy, float* dx, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        float cdf = 0.5f * (1.0f + erff(v * 0.70710678118654752f));
        float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
        dx[i] = dy[i] * (cdf + v * pdf);
    }
}

// Cross-entropy with logits, one thread per row: loss[r] = lse - logit[target] and the gradient
// (softmax - onehot) / rows. Targets are checked on the host before the launch.
extern "C" __global__ void xent_rows(const float* logits, const int* targets, float* grad, double* loss,
                                     int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = logits + (long long)r * cols;
    float m = __int_as_float(0xff800000);  // -inf
    for (int c = 0; c < cols; ++c) m = fmaxf(m, row[c]);
    double sum = 0.0;
    for (int c = 0; c < cols; ++c) sum += exp((double)(row[c] - m));
    double lse = (double)m + log(sum);
    int t = targets[r];
    loss[r] = lse - (double)row[t];
    double inv_rows = 1.0 / (double)rows;
    for (int c = 0; c < cols; ++c) {
        double p = exp((double)row[c] - lse);
        double onehot = (c == t) ? 1.0 : 0.0;
        grad[(long long)r * cols + c] = (float)((p - onehot) * inv_rows);
    }
}

// One AdamW step over a parameter buffer; bias corrections bc1, bc2 computed on the host.
extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v, int n, float lr,
                                      float beta1, float beta2, float eps, float wd, float bc1, float bc2) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gi = g[i];
    float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float update = (mi / bc1) / (sqrtf(vi / bc2) + eps);
    p[i] -= lr * (update + wd * p[i]);
}

// Attention, per head: q, k, v and ctx are row-major (seqs * seq_len) x (heads * dh), head h in
// columns h*dh..; probs and ds are [seq][head][query][key].

// Forward, one thread per (seq, head, query i): probs row = softmax(q_i . k_j * scale), ctx_i = sum_j p_ij v_j.
extern "C" __global__ void attn_fwd(const float* q, const float* k, const float* v, float* probs, float* ctx,
                                    int seqs, int heads, int seq_len, int dh, float scale) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= seqs * heads * seq_len) return;
    int i = idx % seq_len;
    int sh = idx / seq_len;
    int h = sh % heads, s = sh / heads;
    int dim = heads * dh;
    const float* qi = q + (long long)(s * seq_len + i) * dim + h * dh;
    float* pr = probs + (long long)idx * seq_len;
    float m = __int_as_float(0xff800000);
    for (int j = 0; j < seq_len; ++j) {
        const float* kj = k + (long long)(s * seq_len + j) * dim + h * dh;
        float acc = 0.0f;
        for (int c = 0; c < dh; ++c) acc += qi[c] * kj[c];
        acc *= scale;
        pr[j] = acc;
        m = fmaxf(m, acc);
    }
    float sum = 0.0f;
    for (int j = 0; j < seq_len; ++j) {
        float e = expf(pr[j] - m);
        pr[j] = e;
        sum += e;
    }
    float inv = 1.0f / sum;
    for (int j = 0; j < seq_len; ++j) pr[j] *= inv;
    float* ci = ctx + (long long)(s * seq_len + i) * dim + h * dh;
    for (int c = 0; c < dh; ++c) {
        float acc = 0.0f;
        for (int j = 0; j < seq_len; ++j) acc += pr[j] * v[(long long)(s * seq_len + j) * dim + h * dh + c];
        ci[c] = acc;
    }
}

// Backward, one thread per (seq, head, query i): dP_ij = dC_i . v_j, dS_ij = P_ij (dP_ij - P_i . dP_i) * scale,
// dq_i = sum_j dS_ij k_j. dS is kept for attn_bwd_kv.
extern "C" __global__ void attn_bwd_q(const float* k, const float* v, const float* probs, const float* dctx,
                                      float* ds, float* dq, int seqs, int heads, int seq_len, int dh, float scale) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= seqs * heads * seq_len) return;
    int i = idx % seq_len;
    int sh = idx / seq_len;
    int h = sh % heads, s = sh / heads;
    int dim = heads * dh;
    const float* dci = dctx + (long long)(s * seq_len + i) * dim + h * dh;
    const float* pr = probs + (long long)idx * seq_len;
    float* dsr = ds + (long long)idx * seq_len;
    float pd = 0.0f;
    for (int j = 0; j < seq_len; ++j) {
        const float* vj = v + (long long)(s * seq_len + j) * dim + h * dh;
        float acc = 0.0f;
        for (int c = 0; c < dh; ++c) acc += dci[c] * vj[c];
        dsr[j] = acc;
        pd += pr[j] * acc;
    }
    for (int j = 0; j < seq_len; ++j) dsr[j] = pr[j] * (dsr[j] - pd) * scale;
    float* dqi = dq + (long long)(s * seq_len + i) * dim + h * dh;
    for (int c = 0; c < dh; ++c) {
        float acc = 0.0f;
        for (int j = 0; j < seq_len; ++j) acc += dsr[j] * k[(long long)(s * seq_len + j) * dim + h * dh + c];
        dqi[c] = acc;
    }
}

// Backward, one thread per (seq, head, key j): dk_j = sum_i dS_ij q_i, dv_j = sum_i P_ij dC_i.
extern "C" __global__ void attn_bwd_kv(const float* q, const float* probs, const float* ds, const float* dctx,
                                       float* dk, float* dv, int seqs, int heads, int seq_len, int dh) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= seqs * heads * seq_len) return;
    int j = idx % seq_len;
    int sh = idx / seq_len;
    int h = sh % heads, s = sh / heads;
    int dim = heads * dh;
    long long rows0 = (long long)sh * seq_len * seq_len;
    float* dkj = dk + (long long)(s * seq_len + j) * dim + h * dh;
    float* dvj = dv + (long long)(s * seq_len + j) * dim + h * dh;
    for (int c = 0; c < dh; ++c) {
        float ak = 0.0f, av = 0.0f;
        for (int i = 0; i < seq_len; ++i) {
            long long at = rows0 + (long long)i * seq_len + j;
            long long row = (long long)(s * seq_len + i) * dim + h * dh + c;
            ak += ds[at] * q[row];
            av += probs[at] * dctx[row];
        }
        dkj[c] = ak;
        dvj[c] = av;
    }
}
"#;
