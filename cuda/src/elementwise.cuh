// Gemma 4's elementwise ops (`gelu_tanh_mul`, `scale_by`, `add_to`, `add_parts`,
// `concat_columns`, `add_rows_scaled`, `rope_rows`). Host side: their `Kernels` and
// `AssistantKernels` methods (lib.rs, attention.rs). Part of kernels.cu's one compilation
// unit (included in order).

// Gemma 4's elementwise ops: each element (or row) on its own.

// gate <- gelu_tanh(gate) * up (gelu_pytorch_tanh).
extern "C" __global__ void gelu_tanh_mul(float* g, const float* u, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = g[i];
        g[i] = 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x))) * u[i];
    }
}

// x <- x * s
extern "C" __global__ void scale_by(float* x, float s, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}

// x <- x + y
extern "C" __global__ void add_to(float* x, const float* y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + y[i];
}

// x <- x + parts[0] + parts[1] + ... + parts[n-1], one part after another in that order
// (reversed: the negative control's order); parts holds n blocks of len (tensor-parallel
// ranks' partial sums).
extern "C" __global__ void add_parts(float* x, const float* parts, long long len, int n, int reversed) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float acc = x[i];
    for (int k = 0; k < n; ++k) acc = acc + parts[(long long)(reversed ? n - 1 - k : k) * len + i];
    x[i] = acc;
}

// out[t][r * width + j] = parts[r][t][j]: n blocks of m x width side by side.
extern "C" __global__ void concat_columns(float* out, const float* parts, int n, long long width, long long m) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * m * width) return;
    const long long r = i / (m * width), t = (i / width) % m, j = i % width;
    out[(t * n + r) * width + j] = parts[i];
}

// out[rows[i]] += weights[i] * src[i] (rows `width` wide, distinct within a call). grid:
// rows of src.
extern "C" __global__ void add_rows_scaled(float* out, const float* src, const int* rows, const float* weights,
                                           int width) {
    const long long i = blockIdx.x;
    float* o = out + (long long)rows[i] * width;
    const float w = weights[i];
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = o[c] + src[i * width + c] * w;
}

// RoPE of every hd-wide head of each `width`-wide row r of x at pos[r] (an assistant's
// queries, whose positions are not a forward's). grid: (rows, heads), block: 128.
extern "C" __global__ void rope_rows(float* x, int width, int hd, const int* pos, const float* cos_t,
                                     const float* sin_t) {
    const int half = hd / 2;
    float* h = x + (long long)blockIdx.x * width + blockIdx.y * hd;
    const float* c = cos_t + (long long)pos[blockIdx.x] * half;
    const float* s = sin_t + (long long)pos[blockIdx.x] * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float x1 = h[i], x2 = h[i + half];
        h[i] = x1 * c[i] - x2 * s[i];
        h[i + half] = x2 * c[i] + x1 * s[i];
    }
}
