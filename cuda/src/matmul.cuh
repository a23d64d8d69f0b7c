// The CUDA-core matmul (`linear_*`, `linear_q*`: f32, bf16, f16 and MLX-quantized weights,
// 4, 8 or 16 rows a pass) and its canonical order of one output. Host side: matmul.rs and
// `Kernels::linear` (lib.rs). Part of kernels.cu's one compilation unit (included in order).

// Matmul: out[r, c] (+)= dot(x[r, :], w[c, :]) + bias[c].
//
// A block of KWARPS warps owns NC output columns for every row; K is dealt to the warps in
// 256-wide chunks, chunk i to warp i % KWARPS (a split fixed by K and constants alone, never
// by M, so small N x K still fills the SMs). Canonical order of one output: lane L of warp w
// accumulates, with fused multiply-adds in increasing k, the elements
// k = 256 (KWARPS t + w) + 8 L + j (t = 0, 1, ..; j = 0..7); then the warp butterfly; then
// the KWARPS warp sums added in warp order. Rows are processed MB at a time only to reuse
// weights from registers (MB = 4, 8 or 16, picked from M by the host); the order of an
// output never depends on M, on MB, on its row block or on the other rows.
#define NC 4
#define KWARPS 8


template <class W, int MB>
__device__ void linear_impl(const float* __restrict__ x, int m, int k, const W w,
                            int n, const float* __restrict__ bias, float* __restrict__ out, int accumulate) {
    __shared__ float part[KWARPS][MB][NC];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int c0 = blockIdx.x * NC;
    const bool vec = (k & 7) == 0;
    for (int r0 = 0; r0 < m; r0 += MB) {
        float acc[MB][NC];
#pragma unroll
        for (int a = 0; a < MB; a++)
#pragma unroll
            for (int c = 0; c < NC; c++) acc[a][c] = 0.0f;
#pragma unroll 2
        for (int kb = (warp * 32 + lane) * 8; kb < k; kb += 256 * KWARPS) {
            float wv[NC][8];
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const int col = min(c0 + c, n - 1);
                const long long at = (long long)col * k + kb;
                if (vec) {
                    w.get8(at, wv[c]);
                } else if constexpr (W::packed) {
                    const F8 t = tail8(w, at, k - kb);
#pragma unroll
                    for (int j = 0; j < 8; j++) wv[c][j] = t.v[j];
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++) wv[c][j] = kb + j < k ? w.get(at + j) : 0.0f;
                }
            }
#pragma unroll
            for (int a = 0; a < MB; a++) {
                const int r = r0 + a;
                if (r >= m) break;
                float xv[8];
                const float* xr = x + (long long)r * k + kb;
                if (vec) {
                    float4 p = *reinterpret_cast<const float4*>(xr);
                    float4 q = *reinterpret_cast<const float4*>(xr + 4);
                    xv[0] = p.x; xv[1] = p.y; xv[2] = p.z; xv[3] = p.w;
                    xv[4] = q.x; xv[5] = q.y; xv[6] = q.z; xv[7] = q.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++) xv[j] = kb + j < k ? xr[j] : 0.0f;
                }
#pragma unroll
                for (int c = 0; c < NC; c++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[a][c] = fmaf(xv[j], wv[c][j], acc[a][c]);
            }
        }
#pragma unroll
        for (int a = 0; a < MB; a++)
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const float s = warp_sum(acc[a][c]);
                if (lane == c) part[warp][a][c] = s;
            }
        __syncthreads();
        for (int i = threadIdx.x; i < MB * NC; i += blockDim.x) {
            const int a = i / NC, c = i % NC;
            const int r = r0 + a, col = c0 + c;
            if (r < m && col < n) {
                float y = part[0][a][c];
#pragma unroll
                for (int v = 1; v < KWARPS; v++) y += part[v][a][c];
                if (bias) y += bias[col];
                float* o = out + (long long)r * n + col;
                *o = accumulate ? *o + y : y;
            }
        }
        __syncthreads();
    }
}

#define LINEAR(NAME, W, T, MB)                                                                            \
    extern "C" __global__ void NAME(const float* x, int m, int k, const T* w, int n, const float* bias,    \
                                    float* out, int accumulate) {                                         \
        linear_impl<W, MB>(x, m, k, W{w}, n, bias, out, accumulate);                                      \
    }
LINEAR(linear_f32_4, F32W, float, 4)
LINEAR(linear_f32_8, F32W, float, 8)
LINEAR(linear_f32_16, F32W, float, 16)
LINEAR(linear_bf16_4, Bf16W, u16, 4)
LINEAR(linear_bf16_8, Bf16W, u16, 8)
LINEAR(linear_bf16_16, Bf16W, u16, 16)
LINEAR(linear_f16_4, F16W, u16, 4)
LINEAR(linear_f16_8, F16W, u16, 8)
LINEAR(linear_f16_16, F16W, u16, 16)

#define LINEAR_Q(NAME, BITS, MB)                                                                          \
    extern "C" __global__ void NAME(const float* x, int m, int k, const u32* q, const float* scale,        \
                                    const float* qbias, int group, int n, const float* bias, float* out,   \
                                    int accumulate) {                                                     \
        linear_impl<QW<BITS>, MB>(x, m, k, QW<BITS>::of(q, scale, qbias, group), n, bias, out, accumulate); \
    }
LINEAR_Q(linear_q2_4, 2, 4)
LINEAR_Q(linear_q2_8, 2, 8)
LINEAR_Q(linear_q2_16, 2, 16)
LINEAR_Q(linear_q4_4, 4, 4)
LINEAR_Q(linear_q4_8, 4, 8)
LINEAR_Q(linear_q4_16, 4, 16)
LINEAR_Q(linear_q8_4, 8, 4)
LINEAR_Q(linear_q8_8, 8, 8)
LINEAR_Q(linear_q8_16, 8, 16)
