// The stock-matmul negative control's kernels (`widen_*`, `add_into`). Host side: stock.rs
// and `Kernels::linear` (lib.rs). Part of kernels.cu's one compilation unit (included in
// order).

// Widens a weight matrix to f32 (the cuBLAS negative control's input).
extern "C" __global__ void widen_bf16(const u16* w, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_to_f32(w[i]);
}
extern "C" __global__ void widen_f16(const u16* w, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f16_to_f32(w[i]);
}

// out[r, c] (+)= y[r, c] + bias[c] (the negative control's epilogue). grid: rows.
extern "C" __global__ void add_into(float* out, const float* y, const float* bias, int m, int n, int accumulate) {
    const long long r = blockIdx.x;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float v = y[r * n + c];
        if (bias) v += bias[c];
        out[r * n + c] = accumulate ? out[r * n + c] + v : v;
    }
}
