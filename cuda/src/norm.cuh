// RMSNorm (`rms_norm`, over `block_sum`) and the row ops after it: `swiglu`, `gather_rows`.
// Host side: their `Kernels` methods (lib.rs). Part of kernels.cu's one compilation unit
// (included in order).

// Sum of a block of 256 threads: each warp's butterfly, then warp 0 sums the 8 warp
// totals with the butterfly (missing lanes count as zero). Fixed for a fixed block size.
#define NORM_THREADS 256
__device__ float block_sum(float v, float* shared8) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) shared8[warp] = v;
    __syncthreads();
    float t = lane < NORM_THREADS / 32 ? shared8[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// RMSNorm of each n-wide row of x into columns [col, col + n) of out (rows out_width
// wide). grid: rows, block: 256. Thread t sums x[i]^2 for i = t, t + 256, ... in order.
// Rows of up to NORM_HELD * 256 values stay in registers with their weights between the
// sum and the writes (one round of loads, all in flight at once); longer rows are read
// twice, 8 loads in flight at a time. Either way the same sums and products.
#define NORM_HELD 32
extern "C" __global__ void rms_norm(const float* x, const float* w, int n, float eps, float* out, int out_width,
                                    int col) {
    __shared__ float part[NORM_THREADS / 32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* o = out + (long long)blockIdx.x * out_width + col;
    float s = 0.0f;
    if (n <= NORM_HELD * NORM_THREADS) {
        float v[NORM_HELD], g[NORM_HELD];
#pragma unroll
        for (int u = 0; u < NORM_HELD; u++) {
            const int i = threadIdx.x + u * NORM_THREADS;
            v[u] = i < n ? xr[i] : 0.0f;
            g[u] = i < n ? w[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_HELD; u++)
            if (threadIdx.x + u * NORM_THREADS < n) s = fmaf(v[u], v[u], s);
        s = block_sum(s, part);
        const float inv = 1.0f / sqrtf(s / (float)n + eps);
#pragma unroll
        for (int u = 0; u < NORM_HELD; u++) {
            const int i = threadIdx.x + u * NORM_THREADS;
            if (i < n) o[i] = g[u] * (v[u] * inv);
        }
        return;
    }
    int i = threadIdx.x;
    for (; i + 7 * NORM_THREADS < n; i += 8 * NORM_THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = xr[i + u * NORM_THREADS];
#pragma unroll
        for (int u = 0; u < 8; u++) s = fmaf(v[u], v[u], s);
    }
    for (; i < n; i += NORM_THREADS) s = fmaf(xr[i], xr[i], s);
    s = block_sum(s, part);
    const float inv = 1.0f / sqrtf(s / (float)n + eps);
    i = threadIdx.x;
    for (; i + 7 * NORM_THREADS < n; i += 8 * NORM_THREADS) {
        float v[8], g[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            v[u] = xr[i + u * NORM_THREADS];
            g[u] = w[i + u * NORM_THREADS];
        }
#pragma unroll
        for (int u = 0; u < 8; u++) o[i + u * NORM_THREADS] = g[u] * (v[u] * inv);
    }
    for (; i < n; i += NORM_THREADS) o[i] = w[i] * (xr[i] * inv);
}

// gate <- silu(gate) * up (silu_mul, shared with linear_tc_swiglu's epilogue)
extern "C" __global__ void swiglu(float* g, const float* u, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu_mul(g[i], u[i]);
}

// out[i] = x[rows[i]] (rows of `width`). grid: selected rows.
extern "C" __global__ void gather_rows(const float* x, const int* rows, int width, float* out) {
    const long long src = (long long)rows[blockIdx.x] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[(long long)blockIdx.x * width + c] = x[src + c];
}
