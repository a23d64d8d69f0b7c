// Row-invariant CUDA kernels (design.md, "Rules for every kernel", on the GPU).
//
// Every reduction has one order that depends only on the reduced length and fixed
// constants (a warp of 32 lanes, chunks of 8 elements per lane, key chunks of 32 anchored
// at position 0), never on how many tokens or rows share a launch. Activations are f32;
// weights are read in their checkpoint dtype and widened in registers (bf16 weights go to
// the tensor cores with each activation either rounded to bf16, the default, or split
// exactly into three bf16 terms, `--activations f32`); K/V are stored in the model's KV
// dtype (f32, bf16, or 8- or 4-bit codes, `QKv`). No headers: bf16/f16 are widened by hand.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#include "walk.cuh"

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Round to nearest even (the conversion torch and the CPU code use).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Weight readers: a pointer (or, quantized, pointers and a layout) and how to widen
// element i (flat, row-major) or 8 consecutive elements from an 8-aligned index to f32.
struct F32W {
    static constexpr bool packed = false;
    typedef float T;
    const float* p;
    __device__ float get(long long i) const { return p[i]; }
    __device__ void get8(long long i, float* o) const {
        float4 a = *reinterpret_cast<const float4*>(p + i);
        float4 b = *reinterpret_cast<const float4*>(p + i + 4);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
};
// 8 consecutive 16-bit weights from an 8-aligned index, widened by `Widen`.
template <float (*Widen)(u16)>
__device__ __forceinline__ void widen8(const u16* p, long long i, float* o) {
    uint4 v = *reinterpret_cast<const uint4*>(p + i);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        o[2 * j] = Widen((u16)(w[j] & 0xffffu));
        o[2 * j + 1] = Widen((u16)(w[j] >> 16));
    }
}
struct Bf16W {
    static constexpr bool packed = false;
    typedef u16 T;
    const u16* p;
    __device__ float get(long long i) const { return bf16_to_f32(p[i]); }
    __device__ void get8(long long i, float* o) const { widen8<bf16_to_f32>(p, i, o); }
};
struct F16W {
    static constexpr bool packed = false;
    typedef u16 T;
    const u16* p;
    __device__ float get(long long i) const { return f16_to_f32(p[i]); }
    __device__ void get8(long long i, float* o) const { widen8<f16_to_f32>(p, i, o); }
};
// Values i .. i + 7 of w, zero from `left` on: the last chunk of a K that 8 does not divide.
// Out of line, so this rare path does not take the vector path's registers.
struct F8 {
    float v[8];
};
template <class W>
__device__ __noinline__ F8 tail8(const W w, long long i, int left) {
    F8 t;
#pragma unroll
    for (int j = 0; j < 8; j++) t.v[j] = j < left ? w.get(i + j) : 0.0f;
    return t;
}
// The 16 FP4 (E2M1) values of mxfp4: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__constant__ float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// MLX quantization: value i of a row-major rows x k matrix (g = i / group; rows hold whole
// groups), codes packed 32 / BITS to a u32 from the low bits up. Affine:
// scale[g] * q + bias[g], a multiply then an add, rounded each (never fused). mxfp4 (no
// biases): scale[g] * e2m1(q), exact (the scale is a power of two).
// An affine code's value: scale * code + bias, a multiply then an add, rounded each (never
// fused), as on the CPU: quantized weights and quantized K/V alike.
__device__ __forceinline__ float dequantize(float scale, float bias, u32 code) {
    return __fadd_rn(__fmul_rn(scale, (float)code), bias);
}

template <int BITS>
struct QW {
    static constexpr bool packed = true;
    const u32* q;
    const float* scale;
    const float* bias;
    int group;
    // log2(group) when it is a power of two (every size mlx writes), else -1: a shift in
    // place of a 64-bit division per lookup.
    int group_shift;
    // The one way to make a QW (group_shift derived, never left to a default).
    static __device__ QW of(const u32* q, const float* scale, const float* bias, int group) {
        return QW{q, scale, bias, group, (group & (group - 1)) == 0 ? __ffs(group) - 1 : -1};
    }
    __device__ long long group_of(long long i) const { return group_shift >= 0 ? i >> group_shift : i / group; }
    __device__ float get(long long i) const {
        const int per = 32 / BITS;
        const u32 w = q[i / per];
        const u32 code = (w >> ((int)(i % per) * BITS)) & ((1u << BITS) - 1u);
        const long long g = group_of(i);
        if (bias == nullptr) return __fmul_rn(scale[g], E2M1[code & 15u]);
        return dequantize(scale[g], bias[g], code);
    }
    // Values i .. i + 7 (i a multiple of 8): the same bits as eight get()s, with one group
    // lookup and the packed words read once (a group of 8k values holds all eight).
    __device__ void get8(long long i, float* o) const {
        if ((group & 7) != 0) {
            const F8 t = tail8(*this, i, 8);
#pragma unroll
            for (int j = 0; j < 8; j++) o[j] = t.v[j];
            return;
        }
        const long long g = group_of(i);
        const float s = scale[g];
        const float b = bias == nullptr ? 0.0f : bias[g];
        // 8 values are a quarter word (2-bit: at bit 0 or 16), one word, or two words.
        const u32* at = q + (i * BITS >> 5);
        const int shift = BITS == 2 ? (int)(i & 15) * 2 : 0;
        u32 words[BITS == 8 ? 2 : 1];
#pragma unroll
        for (int w = 0; w < (BITS == 8 ? 2 : 1); w++) words[w] = at[w];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int bit = shift + j * BITS;
            const u32 code = (words[BITS == 8 ? j / 4 : 0] >> (bit & 31)) & ((1u << BITS) - 1u);
            o[j] = bias == nullptr ? __fmul_rn(s, E2M1[code & 15u]) : dequantize(s, b, code);
        }
    }
};

// The one warp reduction: xor butterfly 16, 8, 4, 2, 1. Float addition is commutative,
// so every lane ends with the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------
// Tensor-core matmul for bf16 weights with K % 32 == 0 (the weight alone picks this path,
// never M). mma.sync m16n8k16 (bf16 in, f32 accumulate): A = 16 weight rows (16 output
// columns) x 16 k, B = 16 k x 8 tokens. TERMS = 3: each f32 activation is split exactly
// into three bf16 terms x = h + m + l (so every product with a bf16 weight is exact and
// activations keep f32 precision; only the accumulation differs from an f32 dot product).
// TERMS = 1: each activation is rounded to bf16 (h alone, round to nearest even), one MMA a
// product, as transformers and vLLM compute bf16 models. The two are two numerics; within
// each, every kernel below gives the same bits.
//
// A block of KWARPS warps owns 16 output columns. Canonical order of one output: K is cut
// into 128-wide chunks of four 32-wide blocks, chunk i accumulated by warp i % KWARPS (a
// warp streams 256 contiguous bytes of each weight row), blocks in increasing k; within a
// block two MMA steps (k 0..15 and 16..31 of a fixed permutation: lane 4g + t holds k
// 8t..8t+3 in step 0 and 8t+4..8t+7 in step 1), each step the h, m, l MMAs in that order
// (h alone with TERMS = 1);
// then the KWARPS warp sums added in warp order. One MMA adds its 16 products and the
// accumulator as a set, in an order fixed by the hardware: which of the 8 token columns a
// row occupies does not change its bits, so a row's bits do not depend on M, on the tokens
// per pass (8 MT) or on its place in a tile; nor does which register holds which k, and
// wgmma (hopper.cu) gives the bits of mma.sync over the same 16 k (cuda/probes/mma_bits.cu,
// H200, 2026-11-26).
#define TC_COLS 16
#define TC_CHUNK 128

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float lo_f32(u32 p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float hi_f32(u32 p) { return __uint_as_float(p & 0xffff0000u); }

// Splits the pairs (a, b) into h, m, l bf16x2 words: a = h.lo + m.lo + l.lo, same for b.
__device__ __forceinline__ void split3(float a, float b, u32& h, u32& m, u32& l) {
    h = pack_bf16x2(a, b);
    a -= lo_f32(h);
    b -= hi_f32(h);
    m = pack_bf16x2(a, b);
    a -= lo_f32(m);
    b -= hi_f32(m);
    l = pack_bf16x2(a, b);
}

__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Each warp's accumulators (acc[c][j][0..1] = (MMA row g of column group c, tokens 8j + 2t,
// +1), acc[c][j][2..3] = (row g + 8, same)) added into `sum` (row 16 c + MMA row) in warp
// order.
template <int MT, int CB = 1>
__device__ __forceinline__ void add_warp_sums(float (*sum)[8 * MT], const float (&acc)[CB][MT][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    for (int v = 0; v < KWARPS; v++) {
        if (warp == v) {
#pragma unroll
            for (int c = 0; c < CB; c++)
#pragma unroll
                for (int j = 0; j < MT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float* y = &sum[TC_COLS * c + g + 8 * (e >> 1)][8 * j + 2 * t + (e & 1)];
                        *y = v == 0 ? acc[c][j][e] : *y + acc[c][j][e];
                    }
        }
        __syncthreads();
    }
}

// The end of a tensor-core pass (linear_tc, linear_tcq): add_warp_sums, then each output
// of the pass's tokens r0 .. (plus its bias) written to `out` or added to it.
template <int MT, int CB = 1>
__device__ __forceinline__ void store_warp_sums(float (*sum)[8 * MT], const float (&acc)[CB][MT][4], int r0, int m,
                                                int c0, int n, const float* __restrict__ bias,
                                                float* __restrict__ out, int accumulate) {
    add_warp_sums<MT, CB>(sum, acc);
    for (int i = threadIdx.x; i < TC_COLS * CB * 8 * MT; i += blockDim.x) {
        const int c = i % (TC_COLS * CB), a = i / (TC_COLS * CB);
        const int r = r0 + a, col = c0 + c;
        if (r < m && col < n) {
            float y = sum[c][a];
            if (bias) y += bias[col];
            float* o = out + (long long)r * n + col;
            *o = accumulate ? *o + y : y;
        }
    }
    __syncthreads();
}

// SwiGLU's one value: silu(g) * u.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// store_warp_sums for linear_tc_swiglu: add_warp_sums, then each of the pass's tokens' 8 CB
// columns written as silu_mul(gate + bias, up + up_bias) (column group c's sum rows 16 c ..
// 16 c + 7 the gate's columns c0 + 8 c .., the next 8 the up's).
template <int MT, int CB = 1>
__device__ __forceinline__ void store_swiglu(float (*sum)[8 * MT], const float (&acc)[CB][MT][4], int r0, int m,
                                             int c0, int n, const float* __restrict__ bias,
                                             const float* __restrict__ up_bias, float* __restrict__ out) {
    add_warp_sums<MT, CB>(sum, acc);
    constexpr int COLS = TC_COLS / 2 * CB;
    for (int i = threadIdx.x; i < COLS * 8 * MT; i += blockDim.x) {
        const int c = i % COLS, a = i / COLS;
        const int r = r0 + a, col = c0 + c, row = TC_COLS * (c / 8) + c % 8;
        if (r < m && col < n) {
            float gv = sum[row][a], uv = sum[row + TC_COLS / 2][a];
            if (bias) gv += bias[col];
            if (up_bias) uv += up_bias[col];
            out[(long long)r * n + col] = silu_mul(gv, uv);
        }
    }
    __syncthreads();
}

// 16 bytes of a weight streamed by a pass kernel: through the non-coherent path (a forward
// never writes its weights), not kept in L1 (each is read once a pass), the L2 fetching the
// whole 256-byte sector group (the next lanes' and warps' bytes). 8B decode on the H100:
// +3.5% at B=1, +6.5% at B=8 over a plain load (docs/notes/cuda-speed-notes.md, v22).
__device__ __forceinline__ uint4 ld_weights16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// MT token tiles: 8 MT tokens per pass over the weights (never changes an output's order).
// CB column groups: a block owns 16 CB columns, each warp multiplying every group by the same
// activation fragments (at 8 tokens a lane's activations are its own token's, read from L1
// once per CB groups instead of once per group; the order of each output is unchanged).
// `block`: which 16 CB columns (blockIdx.x, or its place among a multi-weight launch's parts).
// With SWIGLU (linear_tc_swiglu): a group's 16 MMA rows are 8 columns of w (the gate) and
// the same 8 of `up`, and it writes out = silu_mul(gate + bias, up + up_bias) for them: each
// dot the MMAs' same sum (which MMA row holds a weight row never changes its bits), each
// value swiglu's of what the two outputs would have held.
template <int MT, int TERMS, bool SWIGLU = false, int CB = 1>
__device__ void linear_tc_impl(const float* __restrict__ x, int m, int k, const u16* __restrict__ w, int n,
                               const float* __restrict__ bias, float* __restrict__ out, int accumulate,
                               int block, const u16* __restrict__ up = nullptr,
                               const float* __restrict__ up_bias = nullptr) {
    __shared__ float sum[TC_COLS * CB][8 * MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int GROUP_COLS = SWIGLU ? TC_COLS / 2 : TC_COLS;
    const int c0 = block * GROUP_COLS * CB;
    // This lane's two weight rows a group (g, g + 8; with `up`, row g of w and of up); rows
    // past n read the last row (their outputs are never stored).
    const u16* wr[CB][2];
#pragma unroll
    for (int c = 0; c < CB; c++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            wr[c][h] = SWIGLU ? (h ? up : w) + (long long)min(c0 + GROUP_COLS * c + g, n - 1) * k + 8 * t
                              : w + (long long)min(c0 + GROUP_COLS * c + 8 * h + g, n - 1) * k + 8 * t;
    for (int r0 = 0; r0 < m; r0 += 8 * MT) {
        float acc[CB][MT][4];
#pragma unroll
        for (int c = 0; c < CB; c++)
#pragma unroll
            for (int j = 0; j < MT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[c][j][e] = 0.0f;
        for (int kc = warp * TC_CHUNK; kc < k; kc += TC_CHUNK * KWARPS) {
            // The chunk's blocks, loaded before their MMAs.
            uint4 wv[TC_CHUNK / 32][CB][2];
#pragma unroll
            for (int u = 0; u < TC_CHUNK / 32; u++) {
                const int kb = kc + u * 32;
                if (kb < k) {
#pragma unroll
                    for (int c = 0; c < CB; c++)
#pragma unroll
                        for (int h = 0; h < 2; h++) wv[u][c][h] = ld_weights16(wr[c][h] + kb);
                }
            }
#pragma unroll
            for (int u = 0; u < TC_CHUNK / 32; u++) {
                const int kb = kc + u * 32;
                if (kb >= k) break;
#pragma unroll
                for (int j = 0; j < MT; j++) {
                    if (r0 + 8 * j >= m) break;
                    const int r = r0 + 8 * j + g;
                    // Rows past m read row m - 1 and count as zero (no branch before the MMAs).
                    const float* xr = x + (long long)min(r, m - 1) * k + kb + 8 * t;
                    const float keep = r < m ? 1.0f : 0.0f;
                    float4 p = *reinterpret_cast<const float4*>(xr), q = *reinterpret_cast<const float4*>(xr + 4);
                    u32 b[3][4];  // [h, m, l][k pairs 0-1, 2-3, 4-5, 6-7 of this lane's 8]
                    // (with TERMS = 1 the m and l terms are dead code, never computed)
                    split3(p.x * keep, p.y * keep, b[0][0], b[1][0], b[2][0]);
                    split3(p.z * keep, p.w * keep, b[0][1], b[1][1], b[2][1]);
                    split3(q.x * keep, q.y * keep, b[0][2], b[1][2], b[2][2]);
                    split3(q.z * keep, q.w * keep, b[0][3], b[1][3], b[2][3]);
#pragma unroll
                    for (int c = 0; c < CB; c++) {
                        const uint4 a = wv[u][c][0], a8 = wv[u][c][1];
#pragma unroll
                        for (int sp = 0; sp < TERMS; sp++)
                            mma_bf16(acc[c][j], a.x, a8.x, a.y, a8.y, b[sp][0], b[sp][1]);
#pragma unroll
                        for (int sp = 0; sp < TERMS; sp++)
                            mma_bf16(acc[c][j], a.z, a8.z, a.w, a8.w, b[sp][2], b[sp][3]);
                    }
                }
            }
        }
        if constexpr (SWIGLU)
            store_swiglu<MT, CB>(sum, acc, r0, m, c0, n, bias, up_bias, out);
        else
            store_warp_sums<MT, CB>(sum, acc, r0, m, c0, n, bias, out, accumulate);
    }
}

// Each kernel in two numerics: NAME_x3 (activations as three exact bf16 terms) and NAME_x1
// (activations rounded to bf16).
// CB = 2: 32 columns a block (two groups), the wide passes of 8 or 16 tokens on wide weights.
#define LINEAR_TC_T(NAME, MT, TERMS, CB)                                                                  \
    extern "C" __global__ void NAME(const float* x, int m, int k, const u16* w, int n, const float* bias,  \
                                    float* out, int accumulate) {                                         \
        linear_tc_impl<MT, TERMS, false, CB>(x, m, k, w, n, bias, out, accumulate, blockIdx.x);           \
    }
#define LINEAR_TC(NAME, MT, CB) LINEAR_TC_T(NAME##_x3, MT, 3, CB) LINEAR_TC_T(NAME##_x1, MT, 1, CB)
LINEAR_TC(linear_tc_bf16_8, 1, 1)
LINEAR_TC(linear_tc_bf16_16, 2, 1)
LINEAR_TC(linear_tc_bf16_32, 4, 1)
LINEAR_TC(linear_tc_bf16_64, 8, 1)
LINEAR_TC(linear_tc_wide_bf16_8, 1, 2)
LINEAR_TC(linear_tc_wide_bf16_16, 2, 2)

// Up to 3 weights over the same activations in one launch (q/k/v, gate/up): blocks
// [first_block[i], first_block[i + 1]) compute part i's columns, each output exactly as its
// own launch would (one wide grid instead of narrow ones that leave SMs idle).
struct TcParts {
    const u16* w[3];
    const float* bias[3];
    float* out[3];
    int n[3];
    int first_block[3];
    int parts;
};
// Part i's field, chosen by conditionals (a dynamic index would copy the struct to the stack).
#define TC_PART(p, field, i) ((i) == 0 ? (p).field[0] : (i) == 1 ? (p).field[1] : (p).field[2])
#define LINEAR_TC_PARTS_T(NAME, MT, TERMS)                                                       \
    extern "C" __global__ void NAME(const float* x, int m, int k, TcParts p) {                  \
        const int b = blockIdx.x;                                                               \
        const int i = (p.parts > 2 && b >= p.first_block[2]) ? 2 : (p.parts > 1 && b >= p.first_block[1]) ? 1 : 0; \
        linear_tc_impl<MT, TERMS>(x, m, k, TC_PART(p, w, i), TC_PART(p, n, i), TC_PART(p, bias, i), \
                                  TC_PART(p, out, i), 0, b - TC_PART(p, first_block, i));       \
    }
#define LINEAR_TC_PARTS(NAME, MT) LINEAR_TC_PARTS_T(NAME##_x3, MT, 3) LINEAR_TC_PARTS_T(NAME##_x1, MT, 1)
LINEAR_TC_PARTS(linear_tc_parts_bf16_8, 1)
LINEAR_TC_PARTS(linear_tc_parts_bf16_16, 2)
LINEAR_TC_PARTS(linear_tc_parts_bf16_32, 4)

// SwiGLU's gate and up projections and silu(gate) * up in one launch (n columns each, 8 a
// block): out = what linear_tc_parts then swiglu would leave in the gate's output.
// CB = 2: 16 gate and 16 up columns a block (two groups), the wide passes.
#define LINEAR_TC_SWIGLU_T(NAME, MT, TERMS, CB)                                                             \
    extern "C" __global__ void NAME(const float* x, int m, int k, const u16* gate, const u16* up, int n,    \
                                    const float* gate_bias, const float* up_bias, float* out) {             \
        linear_tc_impl<MT, TERMS, true, CB>(x, m, k, gate, n, gate_bias, out, 0, blockIdx.x, up, up_bias);  \
    }
#define LINEAR_TC_SWIGLU(NAME, MT, CB) LINEAR_TC_SWIGLU_T(NAME##_x3, MT, 3, CB) LINEAR_TC_SWIGLU_T(NAME##_x1, MT, 1, CB)
LINEAR_TC_SWIGLU(linear_tc_swiglu_bf16_8, 1, 1)
LINEAR_TC_SWIGLU(linear_tc_swiglu_bf16_16, 2, 1)
LINEAR_TC_SWIGLU(linear_tc_swiglu_bf16_32, 4, 1)
LINEAR_TC_SWIGLU(linear_tc_swiglu_wide_bf16_8, 1, 2)
LINEAR_TC_SWIGLU(linear_tc_swiglu_wide_bf16_16, 2, 2)

// ---------------------------------------------------------------------------------------
// MLX-quantized weights on the tensor cores, bf16 activations (affine 4- or 8-bit codes,
// groups of 32, 64 or 128, bf16 scales and biases: what `mlx_lm.convert -q` writes for a
// bf16 model). The codes are exact in bf16, so per group the MMAs sum bf16(x) * code from
// zero (dot) and the group then adds scale * dot + c * xsum to the output, xsum the sum of
// the group's bf16(x): acc = acc + fma(scale, dot, c * xsum), each op rounded once. 4-bit
// codes enter the MMAs as bf16 128 + q (one lop3 makes two from the packed word), so
// c = fma(-128, scale, bias); 8-bit codes enter as q, c = bias. `sb`: one word per
// (row, group), the scale's bf16 bits low, the bias's high.
//
// The codes come repacked at upload (`repack_codes` in lib.rs): in each row's chunk of 128
// k (4 blocks of 32, BITS words a block, lane t's WORDS = BITS / 4 words of a block at t
// WORDS), lane t's words of the chunk's U blocks sit together, word (u, t, v) at
// t U WORDS + u WORDS + v: a whole chunk (U = 4) is one 16-byte load a lane at 4 bits, two
// at 8 (the MLX order took 4 or 8 four-byte loads). `tcq_word` maps an MLX word to it.
//
// prep_q_acts makes, once per input, the bf16 activations as the MMAs take them (xb: of
// each 8 values k, the pairs (k + j, k + j + 4), j = 0..3) and xsum per token and group
// (xs). Canonical order of one output: linear_tc's chunks (128 k, chunk i to warp
// i % KWARPS, the warp sums added in warp order); in a chunk its groups in increasing k (a
// group never spans chunks: it divides 128 and K), in a group its 32-wide blocks in
// increasing k, two MMA steps a block: lane 4g + t's pairs j = 0, 1 of its 8 values
// 8t .. 8t + 7, then j = 2, 3. xsum: the group's blocks in increasing k, a block's sum
// (p0 + p1) + (p2 + p3), p_t its values 8t .. 8t + 7 added in pair order. No output's
// order depends on M, on the tokens per pass, on the other rows or on the other parts.
// Chunks a warp loads before their MMAs (4 at 4 bits measured no faster, 2026-11-26).
#define Q_CHUNKS 2

// One warp per (token, 256 values of K): lane i makes the pairs of values 8i .. 8i + 7 and
// their sum p; the quads add their block sums, (p0 + p1) + (p2 + p3); the first lane of a
// group adds its blocks in increasing k (a group divides 256).
extern "C" __global__ void prep_q_acts(const float* __restrict__ x, int m, int k, int group, u32* __restrict__ xb,
                                       float* __restrict__ xs) {
    const int lane = threadIdx.x & 31;
    const int spans = (k + 255) / 256;
    const long long warps = (long long)m * spans;
    for (long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5; w < warps;
         w += ((long long)gridDim.x * blockDim.x) >> 5) {
        const long long r = w / spans;
        const int k0 = (int)(w % spans) * 256 + 8 * lane;
        const bool live = k0 < k;
        float p = 0.0f;
        if (live) {
            const float4 lo = *reinterpret_cast<const float4*>(x + r * k + k0);
            const float4 hi = *reinterpret_cast<const float4*>(x + r * k + k0 + 4);
            const u32 v[4] = {pack_bf16x2(lo.x, hi.x), pack_bf16x2(lo.y, hi.y), pack_bf16x2(lo.z, hi.z),
                              pack_bf16x2(lo.w, hi.w)};
#pragma unroll
            for (int j = 0; j < 4; j++) p = __fadd_rn(__fadd_rn(p, lo_f32(v[j])), hi_f32(v[j]));
            *reinterpret_cast<uint4*>(xb + (r * k + k0) / 2) = make_uint4(v[0], v[1], v[2], v[3]);
        }
        float q = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, 1));
        q = __fadd_rn(q, __shfl_xor_sync(0xffffffffu, q, 2));
        const int blocks = group >> 5;
        float sum = 0.0f;
        for (int j = 0; j < blocks; j++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, q, (lane + 4 * j) & 31));
        if (live && (lane & (4 * blocks - 1)) == 0) xs[r * (k / group) + k0 / group] = sum;
    }
}

// Where MLX word o of a row of `blocks` 32-value blocks sits in the repacked row.
template <int BITS>
__device__ __forceinline__ long long tcq_word(long long o, int blocks) {
    constexpr int WORDS = BITS / 4;
    const int b = (int)(o / BITS), rem = (int)(o % BITS);
    const int c = b >> 2, u = b & 3, used = min(4, blocks - 4 * c);
    return (long long)c * 4 * BITS + (rem / WORDS) * used * WORDS + u * WORDS + rem % WORDS;
}

// Byte j of w as an exact f32 (2^23 + byte, less 2^23).
__device__ __forceinline__ float byte_f32(u32 w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | j)) - 8388608.0f;
}
// A lane's 8 codes of one weight row (words: 1 for 4-bit, 2 for 8-bit) as the A-fragment
// pairs (code j, code j + 4), j = 0..3: 4-bit as bf16 128 + q (0x4300 | q), 8-bit as q.
template <int BITS>
__device__ __forceinline__ void code_pairs(const u32* words, u32* p) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if constexpr (BITS == 4) {
            p[j] = ((words[0] >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
        } else {
            p[j] = pack_bf16x2(byte_f32(words[0], j), byte_f32(words[1], j));
        }
    }
}

struct TcqParts {
    const u32* q[3];
    const u32* sb[3];
    const float* bias[3];
    float* out[3];
    int n[3];
    int first_block[3];
    int parts;
};

template <int BITS, int MT>
__device__ void linear_tcq_impl(const u32* __restrict__ xb, const float* __restrict__ xs, int m, int k, int group,
                                const u32* __restrict__ q, const u32* __restrict__ sb, int n,
                                const float* __restrict__ bias, float* __restrict__ out, int accumulate, int block) {
    constexpr int WORDS = BITS / 4;  // u32 words holding a lane's 8 codes
    __shared__ float sum[TC_COLS][8 * MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int c0 = block * TC_COLS;
    const int gmask = group - 1;  // 32, 64 or 128
    const int gshift = __ffs(group) - 1;
    const int groups = k >> gshift;
    // This lane's two weight rows (g, g + 8); rows past n read the last row (never stored).
    const u32* qr[2];
    const u32* sr[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const long long row = min(c0 + 8 * h + g, n - 1);
        qr[h] = q + row * (k / 32 * BITS);
        sr[h] = sb + row * groups;
    }
    for (int r0 = 0; r0 < m; r0 += 8 * MT) {
        float acc[1][MT][4]; // one column group: store_warp_sums's shape
#pragma unroll
        for (int j = 0; j < MT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[0][j][e] = 0.0f;
        for (int kc0 = warp * TC_CHUNK; kc0 < k; kc0 += TC_CHUNK * KWARPS * Q_CHUNKS) {
            // Q_CHUNKS chunks' codes and group words, loaded before their MMAs.
            u32 wq[Q_CHUNKS][4][2][WORDS];
            u32 ws[Q_CHUNKS][4][2];
#pragma unroll
            for (int c = 0; c < Q_CHUNKS; c++) {
                const int kc = kc0 + c * TC_CHUNK * KWARPS;
                if (kc >= k) continue;
                const int used = min(4, (k - kc) >> 5);  // the chunk's blocks
                const long long base = (long long)(kc >> 7) * 4 * BITS + t * used * WORDS;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (used == 4) {
#pragma unroll
                        for (int l = 0; l < WORDS; l++) {
                            const uint4 v4 = ld_weights16(qr[h] + base + 4 * l);
                            const u32 w4[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) wq[c][(4 * l + e) / WORDS][h][(4 * l + e) % WORDS] = w4[e];
                        }
                    } else {
#pragma unroll
                        for (int u = 0; u < 4; u++)
                            if (u < used)
#pragma unroll
                                for (int v = 0; v < WORDS; v++) wq[c][u][h][v] = qr[h][base + u * WORDS + v];
                    }
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        if (u < used) ws[c][u][h] = sr[h][(kc + 32 * u) >> gshift];
                }
            }
#pragma unroll
            for (int c = 0; c < Q_CHUNKS; c++) {
                float dot[MT][4], xg[MT][2];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int kb = kc0 + c * TC_CHUNK * KWARPS + u * 32;
                    if (kb >= k) break;
                    if ((kb & gmask) == 0) {
#pragma unroll
                        for (int j = 0; j < MT; j++) {
#pragma unroll
                            for (int e = 0; e < 4; e++) dot[j][e] = 0.0f;
                            // D's tokens 2t and 2t + 1 (rows past m read row m - 1, never stored).
#pragma unroll
                            for (int e = 0; e < 2; e++)
                                xg[j][e] = xs[(long long)min(r0 + 8 * j + 2 * t + e, m - 1) * groups + (kb >> gshift)];
                        }
                    }
                    u32 a[2][4];
#pragma unroll
                    for (int h = 0; h < 2; h++) code_pairs<BITS>(wq[c][u][h], a[h]);
#pragma unroll
                    for (int j = 0; j < MT; j++) {
                        if (r0 + 8 * j >= m) break;
                        // Token columns are independent in an MMA: rows past m read row m - 1.
                        const long long r = min(r0 + 8 * j + g, m - 1);
                        const uint4 b = *reinterpret_cast<const uint4*>(xb + r * (k / 2) + kb / 2 + 4 * t);
                        mma_bf16(dot[j], a[0][0], a[1][0], a[0][1], a[1][1], b.x, b.y);
                        mma_bf16(dot[j], a[0][2], a[1][2], a[0][3], a[1][3], b.z, b.w);
                    }
                    if (((kb + 32) & gmask) == 0) {
                        // Scale and c of the group of rows g and g + 8.
                        float s[2], cb[2];
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            s[h] = lo_f32(ws[c][u][h]);
                            cb[h] = BITS == 4 ? __fmaf_rn(-128.0f, s[h], hi_f32(ws[c][u][h])) : hi_f32(ws[c][u][h]);
                        }
#pragma unroll
                        for (int j = 0; j < MT; j++) {
                            if (r0 + 8 * j >= m) break;
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const int h = e >> 1;
                                acc[0][j][e] = __fadd_rn(acc[0][j][e], __fmaf_rn(s[h], dot[j][e], __fmul_rn(cb[h], xg[j][e & 1])));
                            }
                        }
                    }
                }
            }
        }
        store_warp_sums<MT>(sum, acc, r0, m, c0, n, bias, out, accumulate);
    }
}

// Up to 3 weights of one bits and group size over the same activations in one launch, each
// output as its own launch would write it (as linear_tc_parts).
#define LINEAR_TCQ(NAME, BITS, MT)                                                                          \
    extern "C" __global__ void NAME(const u32* xb, const float* xs, int m, int k, int group, TcqParts p,     \
                                    int accumulate) {                                                       \
        const int b = blockIdx.x;                                                                           \
        const int i = (p.parts > 2 && b >= p.first_block[2]) ? 2 : (p.parts > 1 && b >= p.first_block[1]) ? 1 : 0; \
        linear_tcq_impl<BITS, MT>(xb, xs, m, k, group, TC_PART(p, q, i), TC_PART(p, sb, i), TC_PART(p, n, i),  \
                                  TC_PART(p, bias, i), TC_PART(p, out, i), accumulate, b - TC_PART(p, first_block, i)); \
    }
LINEAR_TCQ(linear_tcq4_8, 4, 1)
LINEAR_TCQ(linear_tcq4_16, 4, 2)
LINEAR_TCQ(linear_tcq4_32, 4, 4)
LINEAR_TCQ(linear_tcq4_64, 4, 8)
LINEAR_TCQ(linear_tcq8_8, 8, 1)
LINEAR_TCQ(linear_tcq8_16, 8, 2)
LINEAR_TCQ(linear_tcq8_32, 8, 4)
LINEAR_TCQ(linear_tcq8_64, 8, 8)

// ---------------------------------------------------------------------------------------
// Tiled tensor-core matmul for many tokens: each output summed in linear_tc's order (so
// with its bits), but a block of 8 warps stages a (32 WCOLS columns) x (64 WN / WCOLS
// tokens) tile's weights and activations in shared memory 32 k at a time (cp.async,
// STAGES deep), so a weight or activation fetched from global memory feeds a whole tile
// instead of 8 tokens or 16 columns. The activations come split once, by split_activations
// (linear_tc splits them in every warp). Warp (wc, wt) holds 32 columns x 8 WN tokens.
// linear_tc's 8 warp partials (chunk i of 128 k to partial i % 8, partials added in warp
// order) become 8 phases walked in order: phase p sums its chunks p, p + 8, .. from zero
// in increasing k and is then added to the running sum.

// x (n f32, n even) split exactly into three bf16 planes h, m, l of n each: x = h + m + l,
// the terms linear_tc's split3 makes (_x3); or rounded to bf16, the plane h alone (_x1).
template <int TERMS>
__device__ void split_activations_impl(const float* x, long long n, u32* out) {
    const long long pairs = n / 2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pairs; i += (long long)gridDim.x * blockDim.x) {
        const float2 v = reinterpret_cast<const float2*>(x)[i];
        u32 t[3];
        split3(v.x, v.y, t[0], t[1], t[2]);
#pragma unroll
        for (int sp = 0; sp < TERMS; sp++) out[sp * pairs + i] = t[sp];
    }
}
extern "C" __global__ void split_activations_x3(const float* x, long long n, u32* out) {
    split_activations_impl<3>(x, n, out);
}
extern "C" __global__ void split_activations_x1(const float* x, long long n, u32* out) {
    split_activations_impl<1>(x, n, out);
}

// x (n f32, n % 32 == 0, rows of k % 32 == 0) rounded to bf16 for the wgmma matmul
// (hopper.cu), each 32-wide block of k stored in its two MMA steps' order: step s at 16 s..,
// its logical k 2t, 2t + 1 (t = 0..3) holding k 8t + 4s, + 1 and its logical k 8 + 2t, + 1
// holding k 8t + 4s + 2, + 3: what lane 4g + t of linear_tc holds in step s. A wgmma over 16
// stored k then meets each activation with the weight linear_tc's MMA meets it with.
extern "C" __global__ void split_activations_steps(const float* x, long long n, u32* out) {
    const long long pairs = n / 2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pairs; i += (long long)gridDim.x * blockDim.x) {
        const int q = (int)(i % 16), s = q / 8, t = q % 4, h = q % 8 / 4;
        const float2 v = reinterpret_cast<const float2*>(x)[i - q + 4 * t + 2 * s + h];
        out[i] = pack_bf16x2(v.x, v.y);
    }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// The walk's position: chunk number i (chunk c) and its 32-wide block u. The walk covers
// every phase in order (phase < 0) or one phase's chunks.
struct TtPos {
    int i, c, u, phase, chunks;
    __device__ TtPos(int phase, int nch)
        : i(0), u(0), phase(phase), chunks(phase < 0 ? nch : (nch - phase + 7) / 8) {
        c = chunk(0, nch);
    }
    __device__ int chunk(int j, int nch) const { return phase < 0 ? tt_chunk(j, nch) : phase + 8 * j; }
    __device__ void next(int nch, int nb) {
        if (++u == min(4, nb - 4 * c)) {
            u = 0;
            if (++i < chunks) c = chunk(i, nch);
        }
    }
    __device__ int kb() const { return 128 * c + 32 * u; }
};

// xs: split_activations of the m x k activations (TERMS planes h, m, l of m k each). PHASED: the
// grid's y holds 8 blocks per token tile, block y walking phase y % 8 alone and writing its
// partial to out[phase][m][n] (no bias), for linear_merge_phases to add in phase order:
// 8 times the blocks, for grids too small to fill the GPU (and no running sum held).
// The STAGES live in dynamic shared memory, weights [STAGES][COLS][32] then activations
// [STAGES][TERMS][TOKS][32]: (COLS + TERMS TOKS) 64 STAGES bytes, which the host passes (and
// raises the kernel's limit to, past 48 KB).
template <int WCOLS, int WN, int STAGES, bool PHASED, int TERMS>
__device__ void linear_tt_impl(const u16* __restrict__ xs, int m, int k, const u16* __restrict__ w, int n,
                               const float* __restrict__ bias, float* __restrict__ out, int accumulate,
                               int col_block) {
    constexpr int COLS = 32 * WCOLS, TOKS = 8 * WN * (8 / WCOLS);
    extern __shared__ __align__(16) unsigned char tt_smem[];
    auto ws = reinterpret_cast<u16 (*)[COLS][32]>(tt_smem);
    auto xsh = reinterpret_cast<u16 (*)[TERMS][TOKS][32]>(tt_smem + STAGES * COLS * 32 * 2);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wc = warp % WCOLS, wt = warp / WCOLS;
    const int c0 = col_block * COLS, r0 = (PHASED ? blockIdx.y / 8 : blockIdx.y) * TOKS;
    const int phase = PHASED ? (int)(blockIdx.y % 8) : -1;
    const int nb = k / 32, nch = (nb + 3) / 4;
    const long long plane = (long long)m * k;
    int steps = nb;
    if (PHASED) {
        steps = 0;
        for (int c = phase; c < nch; c += 8) steps += min(4, nb - 4 * c);
    }

    // Stage s gets the 32-wide block at kb in 16-byte pieces, 4 per weight row and per
    // token and split plane; rows past n and tokens past m repeat the last (their outputs
    // are not stored, and an MMA's token columns never mix).
    auto load = [&](int s, int kb) {
#pragma unroll
        for (int i = 0; i < (COLS * 4 + 255) / 256; i++) {
            const int p = tid + 256 * i;
            if ((COLS * 4) % 256 == 0 || p < COLS * 4)
                cp_async16(&ws[s][p / 4][8 * (p % 4)], w + (long long)min(c0 + p / 4, n - 1) * k + kb + 8 * (p % 4));
        }
#pragma unroll
        for (int i = 0; i < (TOKS * 4 * TERMS + 255) / 256; i++) {
            const int p = tid + 256 * i;
            const int sp = p / (TOKS * 4), tok = p % (TOKS * 4) / 4, piece = p % 4;
            if ((TOKS * 4 * TERMS) % 256 == 0 || p < TOKS * 4 * TERMS)
                cp_async16(&xsh[s][sp][tok][8 * piece],
                           xs + sp * plane + (long long)min(r0 + tok, m - 1) * k + kb + 8 * piece);
        }
    };

    TtPos fetch(phase, nch);
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < steps) {
            load(s, fetch.kb());
            fetch.next(nch, nb);
        }
        cp_async_commit();
    }
    // sum: the running sum over phases (the phased kernel writes each phase's acc alone).
    float acc[2][WN][4], sum[2][WN][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int j = 0; j < WN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[a][j][e] = sum[a][j][e] = 0.0f;
    TtPos at(phase, nch);
    for (int s = 0; s < steps; s++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // block s has landed, and every warp is done with block s - 1's stage
        if (s + STAGES - 1 < steps) {
            load((s + STAGES - 1) % STAGES, fetch.kb());
            fetch.next(nch, nb);
        }
        cp_async_commit();
        const int st = s % STAGES;
        // Lane 4g + t: weight rows g and g + 8 of each 16-column tile and token g of each
        // 8-token tile, k 8t..8t+7 (as in linear_tc: 8t..8t+3 in MMA step 0, the rest in 1).
        uint4 a[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                a[mt][h] = *reinterpret_cast<const uint4*>(&ws[st][32 * wc + 16 * mt + 8 * h + g][8 * t]);
#pragma unroll
        for (int j = 0; j < WN; j++) {
            uint4 b[TERMS];
#pragma unroll
            for (int sp = 0; sp < TERMS; sp++)
                b[sp] = *reinterpret_cast<const uint4*>(&xsh[st][sp][8 * (WN * wt + j) + g][8 * t]);
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const uint4 lo = a[mt][0], hi = a[mt][1];
#pragma unroll
                for (int sp = 0; sp < TERMS; sp++) mma_bf16(acc[mt][j], lo.x, hi.x, lo.y, hi.y, b[sp].x, b[sp].y);
#pragma unroll
                for (int sp = 0; sp < TERMS; sp++) mma_bf16(acc[mt][j], lo.z, hi.z, lo.w, hi.w, b[sp].z, b[sp].w);
            }
        }
        // The end of a phase: its partial joins the running sum, as linear_tc's warp sums do.
        const int c = at.c;
        at.next(nch, nb);
        if (!PHASED && at.u == 0 && c + 8 >= nch) {
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int j = 0; j < WN; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        sum[mt][j][e] = (c & 7) == 0 ? acc[mt][j][e] : sum[mt][j][e] + acc[mt][j][e];
                        acc[mt][j][e] = 0.0f;
                    }
        }
    }
    // Phases without chunks (K < 1024) add linear_tc's idle warps' zeros (a phase block
    // writes its own partial alone).
    for (int p = PHASED ? 8 : nch; p < 8; p++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int j = 0; j < WN; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) sum[mt][j][e] = sum[mt][j][e] + 0.0f;
    // D layout: acc[mt][j][0..1] = (column g, tokens 2t, 2t + 1), [2..3] = (column g + 8, same).
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int j = 0; j < WN; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = c0 + 32 * wc + 16 * mt + g + 8 * (e >> 1);
                const int r = r0 + 8 * (WN * wt + j) + 2 * t + (e & 1);
                if (r >= m || col >= n) continue;
                if (PHASED) {
                    out[((long long)phase * m + r) * n + col] = acc[mt][j][e];
                    continue;
                }
                float y = sum[mt][j][e];
                if (bias) y += bias[col];
                float* o = out + (long long)r * n + col;
                *o = accumulate ? *o + y : y;
            }
}

// Unphased tiles: out (+)= x w^T + bias. Phased: `out` holds the 8 phases' partials
// (8 m n), for linear_merge_phases.
#define LINEAR_TT_T(NAME, WCOLS, WN, STAGES, MIN_BLOCKS, TERMS)                                          \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(const u16* xs, int m, int k, const u16* w,     \
                                                           int n, const float* bias, float* out,         \
                                                           int accumulate) {                             \
        linear_tt_impl<WCOLS, WN, STAGES, false, TERMS>(xs, m, k, w, n, bias, out, accumulate, blockIdx.x); \
    }
#define LINEAR_TT_PHASES_T(NAME, WCOLS, WN, STAGES, MIN_BLOCKS, TERMS)                                   \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(const u16* xs, int m, int k, const u16* w,     \
                                                           int n, float* part) {                         \
        linear_tt_impl<WCOLS, WN, STAGES, true, TERMS>(xs, m, k, w, n, nullptr, part, 0, blockIdx.x);    \
    }
#define LINEAR_TT(NAME, WCOLS, WN, STAGES, MIN_BLOCKS)                                                    \
    LINEAR_TT_T(NAME##_x3, WCOLS, WN, STAGES, MIN_BLOCKS, 3) LINEAR_TT_T(NAME##_x1, WCOLS, WN, STAGES, MIN_BLOCKS, 1)
#define LINEAR_TT_PHASES(NAME, WCOLS, WN, STAGES, MIN_BLOCKS)                                             \
    LINEAR_TT_PHASES_T(NAME##_x3, WCOLS, WN, STAGES, MIN_BLOCKS, 3)                                       \
    LINEAR_TT_PHASES_T(NAME##_x1, WCOLS, WN, STAGES, MIN_BLOCKS, 1)
LINEAR_TT(linear_tt_bf16_256x16, 8, 2, 2, 2)
LINEAR_TT(linear_tt_bf16_128x32, 4, 2, 3, 2)
LINEAR_TT(linear_tt_bf16_64x64, 2, 2, 3, 2)
LINEAR_TT(linear_tt_bf16_128x64, 4, 4, 2, 1)
LINEAR_TT_PHASES(linear_tt_phases_bf16_256x16, 8, 2, 2, 2)
LINEAR_TT_PHASES(linear_tt_phases_bf16_128x32, 4, 2, 3, 2)
LINEAR_TT_PHASES(linear_tt_phases_bf16_64x64, 2, 2, 3, 2)
LINEAR_TT_PHASES(linear_tt_phases_bf16_128x64, 4, 4, 3, 2)
LINEAR_TT_PHASES(linear_tt_phases_bf16_128x48, 4, 3, 3, 2)

// Up to 3 weights over the same split activations, phase-split, in one launch (q/k/v
// past 32 tokens: the narrow k and v alone leave most SMs idle): blocks
// [first_block[i], first_block[i + 1]) of the grid's x write part i's phase partials to
// out[i] exactly as its own phased launch would, for linear_merge_phases (bias unused). Each
// takes its single-weight phased kernel's shape and stages (the host sizes both alike).
#define LINEAR_TT_PARTS_T(NAME, WCOLS, WN, STAGES, MIN_BLOCKS, TERMS)                                    \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(const u16* xs, int m, int k, TcParts p) { \
        const int b = blockIdx.x;                                                                         \
        const int i = (p.parts > 2 && b >= p.first_block[2]) ? 2 : (p.parts > 1 && b >= p.first_block[1]) ? 1 : 0; \
        linear_tt_impl<WCOLS, WN, STAGES, true, TERMS>(xs, m, k, TC_PART(p, w, i), TC_PART(p, n, i), nullptr, \
                                                TC_PART(p, out, i), 0, b - TC_PART(p, first_block, i));   \
    }
#define LINEAR_TT_PARTS(NAME, WCOLS, WN, STAGES, MIN_BLOCKS)                                              \
    LINEAR_TT_PARTS_T(NAME##_x3, WCOLS, WN, STAGES, MIN_BLOCKS, 3)                                        \
    LINEAR_TT_PARTS_T(NAME##_x1, WCOLS, WN, STAGES, MIN_BLOCKS, 1)
LINEAR_TT_PARTS(linear_tt_parts_bf16_128x32, 4, 2, 3, 2)
LINEAR_TT_PARTS(linear_tt_parts_bf16_128x64, 4, 4, 3, 2)
LINEAR_TT_PARTS(linear_tt_parts_bf16_128x48, 4, 3, 3, 2)

// Output i of an m x n phase launch: its 8 partials (part[p][i], mn = m n) added in phase
// order (linear_tc's warp order), + bias.
__device__ __forceinline__ float merged(const float* part, long long mn, long long i, const float* bias, int n) {
    float y = part[i];
#pragma unroll
    for (int p = 1; p < 8; p++) y += part[p * mn + i];
    if (bias) y += bias[i % n];
    return y;
}

// out (+)= the merged partials.
extern "C" __global__ void linear_merge_phases(const float* part, int m, int n, const float* bias, float* out,
                                               int accumulate) {
    const long long mn = (long long)m * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < mn; i += (long long)gridDim.x * blockDim.x) {
        const float y = merged(part, mn, i, bias, n);
        out[i] = accumulate ? out[i] + y : y;
    }
}

// Up to 3 phase launches' merges in one (q/k/v): part i's m n[i] outputs are the flat
// indices [end[i - 1], end[i]), each written as linear_merge_phases writes it.
struct MergeParts {
    const float* part[3];
    const float* bias[3];
    float* out[3];
    long long end[3];
    int n[3];
    int parts;
};
extern "C" __global__ void linear_merge_phases_parts(const __grid_constant__ MergeParts p, int m) {
    const long long total = TC_PART(p, end, p.parts - 1);
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < total; j += (long long)gridDim.x * blockDim.x) {
        const int i = j >= p.end[0] ? (j >= p.end[1] ? 2 : 1) : 0;
        const long long at = j - (i == 0 ? 0 : TC_PART(p, end, i - 1));
        const int n = TC_PART(p, n, i);
        TC_PART(p, out, i)[at] = merged(TC_PART(p, part, i), (long long)m * n, at, TC_PART(p, bias, i), n);
    }
}

// SwiGLU over two phase launches (gate's, up's, both m x n): out = silu_mul of the merged
// gate and up, the bits of their merges and then `swiglu`.
extern "C" __global__ void linear_merge_phases_swiglu(const float* gate, const float* up, int m, int n,
                                                      const float* gate_bias, const float* up_bias, float* out) {
    const long long mn = (long long)m * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < mn; i += (long long)gridDim.x * blockDim.x)
        out[i] = silu_mul(merged(gate, mn, i, gate_bias, n), merged(up, mn, i, up_bias, n));
}

// ---------------------------------------------------------------------------------------
// Embedding rows widened to f32. grid: tokens, block: 256.
template <class W>
__device__ void embed_impl(const W table, const u32* tokens, int cols, float* out) {
    const long long row = (long long)tokens[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(long long)blockIdx.x * cols + c] = table.get(row + c);
}
extern "C" __global__ void embed_f32(const float* t, const u32* tok, int cols, float* out) { embed_impl<F32W>(F32W{t}, tok, cols, out); }
extern "C" __global__ void embed_bf16(const u16* t, const u32* tok, int cols, float* out) { embed_impl<Bf16W>(Bf16W{t}, tok, cols, out); }
extern "C" __global__ void embed_f16(const u16* t, const u32* tok, int cols, float* out) { embed_impl<F16W>(F16W{t}, tok, cols, out); }
#define EMBED_Q(NAME, BITS)                                                                               \
    extern "C" __global__ void NAME(const u32* q, const float* scale, const float* qbias, int group,       \
                                    const u32* tok, int cols, float* out) {                               \
        embed_impl<QW<BITS>>(QW<BITS>::of(q, scale, qbias, group), tok, cols, out);                           \
    }
EMBED_Q(embed_q2, 2)
EMBED_Q(embed_q4, 4)
EMBED_Q(embed_q8, 8)
// The same values from codes repacked for linear_tcq (`tcq_word`): QW's get, the word
// found through the repacked row.
template <int BITS>
__device__ void embed_tcq_impl(const u32* q, const float* scale, const float* qbias, int group, const u32* tok,
                               int cols, float* out) {
    const long long row = tok[blockIdx.x];
    const long long words = (long long)cols * BITS / 32;
    const int gshift = __ffs(group) - 1;  // 32, 64 or 128
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const u32 w = q[row * words + tcq_word<BITS>((long long)c * BITS / 32, cols / 32)];
        const u32 code = (w >> (c * BITS % 32)) & ((1u << BITS) - 1u);
        const long long g = (row * cols + c) >> gshift;
        out[(long long)blockIdx.x * cols + c] = dequantize(scale[g], qbias[g], code);
    }
}
extern "C" __global__ void embed_tcq4(const u32* q, const float* scale, const float* qbias, int group,
                                      const u32* tok, int cols, float* out) {
    embed_tcq_impl<4>(q, scale, qbias, group, tok, cols, out);
}
extern "C" __global__ void embed_tcq8(const u32* q, const float* scale, const float* qbias, int group,
                                      const u32* tok, int cols, float* out) {
    embed_tcq_impl<8>(q, scale, qbias, group, tok, cols, out);
}

// ---------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------
// Logit summaries: of each vocab-wide row, the argmax (lowest index among equal maxima,
// NaN never wins, 0 when nothing beats -inf; written as a float), the max and
// ln(sum(exp(x - max))): three floats a row. grid: rows, block: 1024. Thread t reads
// x[t], x[t + 1024], ... in order (8 loads in flight); its sum then goes through its
// warp's butterfly and warp 0's butterfly over the 32 warp totals: fixed by vocab alone.
#define SUMMARY_THREADS 1024
__device__ __forceinline__ void keep_better(float& v, unsigned& i, float ov, unsigned oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}
__device__ __forceinline__ void warp_best(float& v, unsigned& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) keep_better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}
extern "C" __global__ void logit_summaries(const float* logits, int vocab, float* out) {
    __shared__ float part[SUMMARY_THREADS / 32];
    __shared__ unsigned part_at[SUMMARY_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* x = logits + (long long)blockIdx.x * vocab;
    // Ids rise along each thread's scan, so a strict > keeps its first maximum.
    float best = __int_as_float(0xff800000);
    unsigned at = 0xffffffffu;
    int i = threadIdx.x;
    for (; i + 7 * SUMMARY_THREADS < vocab; i += 8 * SUMMARY_THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = x[i + u * SUMMARY_THREADS];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (v[u] > best) {
                best = v[u];
                at = i + u * SUMMARY_THREADS;
            }
        }
    }
    for (; i < vocab; i += SUMMARY_THREADS) {
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    }
    // (value, id) pairs ordered by value then lower id: any combining order agrees.
    warp_best(best, at);
    if (lane == 0) {
        part[warp] = best;
        part_at[warp] = at;
    }
    __syncthreads();
    best = part[lane];
    at = part_at[lane];
    warp_best(best, at);
    const float max = best;
    float s = 0.0f;
    i = threadIdx.x;
    for (; i + 7 * SUMMARY_THREADS < vocab; i += 8 * SUMMARY_THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = x[i + u * SUMMARY_THREADS];
#pragma unroll
        for (int u = 0; u < 8; u++) s += expf(v[u] - max);
    }
    for (; i < vocab; i += SUMMARY_THREADS) s += expf(x[i] - max);
    s = warp_sum(s);
    __syncthreads();
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        const float total = warp_sum(part[lane]);
        if (lane == 0) {
            float* o = out + 3 * (long long)blockIdx.x;
            o[0] = max > __int_as_float(0xff800000) ? (float)at : 0.0f;
            o[1] = max;
            o[2] = logf(total);
        }
    }
}

// ---------------------------------------------------------------------------------------
#include "forward.cuh"

// Quantized K/V (`--kv-bits 8|4`) in the CPU's format (mtp_cache::QuantLayout): the K (or
// V) of one KV head at one position is one group of words: f32 scale, f32 bias (the
// group's minimum), then hd BITS-bit codes packed low bits first; x = scale * q + bias,
// product and sum rounded apart as on the CPU. A pointer to it steps in words; hd % 8 == 0
// (check_gpu_kv), so a head is whole words and every 8 codes start on a byte.
template <int BITS>
struct QKv {
    u32 w;
};

// K/V access by store type: `BITS` (0: dense), `units(hd)` (what one head takes, in the
// pointer's steps), `get`/`get8` (value d, or values d..d+7 from d % 8 == 0, of the head at
// p + at), `put` (dense: element i).
template <class KV>
struct KvIo;
template <>
struct KvIo<float> {
    static constexpr int BITS = 0;
    __device__ static int units(int hd) { return hd; }
    __device__ static float get(const float* p, long long at, int d) { return p[at + d]; }
    __device__ static void get8(const float* p, long long at, int d, float* o) { F32W{p}.get8(at + d, o); }
    __device__ static void put(float* p, long long i, float v) { p[i] = v; }
};
template <>
struct KvIo<u16> {
    static constexpr int BITS = 0;
    __device__ static int units(int hd) { return hd; }
    __device__ static float get(const u16* p, long long at, int d) { return bf16_to_f32(p[at + d]); }
    __device__ static void get8(const u16* p, long long at, int d, float* o) { widen8<bf16_to_f32>(p, at + d, o); }
    __device__ static void put(u16* p, long long i, float v) { p[i] = f32_to_bf16(v); }
};
template <int B>
struct KvIo<QKv<B>> {
    static constexpr int BITS = B;
    static constexpr u32 MASK = (1u << B) - 1;
    __device__ static int units(int hd) { return 2 + hd * B / 32; }
    __device__ static float get(const QKv<B>* p, long long at, int d) {
        const u32* g = &p[at].w;
        const u32 code = (g[2 + d * B / 32] >> (d * B % 32)) & MASK;
        return dequantize(__uint_as_float(g[0]), __uint_as_float(g[1]), code);
    }
    __device__ static void get8(const QKv<B>* p, long long at, int d, float* o) {
        const u32* g = &p[at].w;
        const float scale = __uint_as_float(g[0]), bias = __uint_as_float(g[1]);
        u32 w[B / 4];
#pragma unroll
        for (int i = 0; i < B / 4; i++) w[i] = g[2 + d * B / 32 + i];
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = dequantize(scale, bias, (w[j * B / 32] >> (j * B % 32)) & MASK);
    }
};

// Quantizes the hd values at h (shared) into the head group g (QKv<BITS> words), as the
// CPU's QuantLayout::quantize_head: lo and hi the minimum and maximum (NaN ignored),
// scale = (hi - lo) / levels, q = round((x - lo) / scale) (half away from zero) clamped to
// [0, levels], NaN to 0. Every thread of the block calls; `part` holds 2 * warps floats.
template <int BITS>
__device__ void quantize_head(const float* h, int hd, u32* g, float* part) {
    float lo = __int_as_float(0x7f800000), hi = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        lo = fminf(lo, h[i]);
        hi = fmaxf(hi, h[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
        part[warp] = lo;
        part[warps + warp] = hi;
    }
    __syncthreads();
    for (int w = 0; w < warps; w++) {
        lo = fminf(lo, part[w]);
        hi = fmaxf(hi, part[warps + w]);
    }
    const float levels = (float)((1u << BITS) - 1);
    const float scale = __fdiv_rn(__fsub_rn(hi, lo), levels);
    const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    if (threadIdx.x == 0) {
        g[0] = __float_as_uint(scale);
        g[1] = __float_as_uint(lo);
    }
    constexpr int PER_WORD = 32 / BITS;
    for (int w = threadIdx.x; w < hd / PER_WORD; w += blockDim.x) {
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < PER_WORD; j++) {
            const float r = roundf(__fmul_rn(__fsub_rn(h[w * PER_WORD + j], lo), inv));
            const u32 q = r >= 0.0f ? (u32)fminf(r, levels) : 0u;  // NaN fails r >= 0
            word |= q << (j * BITS);
        }
        g[2 + w] = word;
    }
}

// Per (token, head): optional per-head RMSNorm (q and k), RoPE at the token's RoPE
// position (HF rotate_half: element i pairs with i + hd/2), then q back in place and K, V
// stored at the token's window slot of layer `layer` (quantized K/V: each head's values
// gathered in shared memory, then `quantize_head`). grid: (tokens, heads + 2 * kv_heads),
// or (tokens, heads) to rotate q alone; block: 128. Requires hd <= 512.
template <class KV>
__device__ void qk_rope_store_impl(float* q, const float* k, const float* v, const float* q_norm,
                                   const float* k_norm, float eps, const float* cos_t, const float* sin_t,
                                   const Tok* toks, const RowKv* rows, int layer, int heads, int kv_heads,
                                   int hd) {
    __shared__ float h[512];
    __shared__ float part[NORM_THREADS / 32];
    const int t = blockIdx.x, y = blockIdx.y;
    const Tok tok = toks[t];
    const RowKv row = rows[tok.row];
    const int kvd = kv_heads * hd;
    const long long slot = kv_slot(row, tok.pos);
    KV* kbuf = reinterpret_cast<KV*>(row.base) + (long long)(2 * layer) * row.plane;
    KV* vbuf = reinterpret_cast<KV*>(row.base) + (long long)(2 * layer + 1) * row.plane;
    constexpr int BITS = KvIo<KV>::BITS;
    // A quantized head's words: slot * (kv_heads heads of `units`) + head * units.
    const int units = KvIo<KV>::units(hd);
    if (y >= heads + kv_heads) {  // V: stored as is
        const int hv = y - heads - kv_heads;
        if constexpr (BITS > 0) {
            for (int i = threadIdx.x; i < hd; i += blockDim.x) h[i] = v[(long long)t * kvd + hv * hd + i];
            __syncthreads();
            quantize_head<BITS>(h, hd, &vbuf[(slot * kv_heads + hv) * units].w, part);
        } else {
            for (int i = threadIdx.x; i < hd; i += blockDim.x)
                KvIo<KV>::put(vbuf, slot * kvd + hv * hd + i, v[(long long)t * kvd + hv * hd + i]);
        }
        return;
    }
    const bool is_q = y < heads;
    const float* src = is_q ? q + (long long)t * heads * hd + y * hd : k + (long long)t * kvd + (y - heads) * hd;
    const float* nw = is_q ? q_norm : k_norm;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) h[i] = src[i];
    __syncthreads();
    if (nw) {
        // One warp per (token, head) would do; a 128-thread block sums in its own fixed order.
        float s = 0.0f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) s = fmaf(h[i], h[i], s);
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        s = warp_sum(s);
        if (lane == 0) part[warp] = s;
        __syncthreads();
        float tot = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        tot = warp_sum(tot);
        const float inv = 1.0f / sqrtf(tot / (float)hd + eps);
        __syncthreads();
        for (int i = threadIdx.x; i < hd; i += blockDim.x) h[i] = nw[i] * (h[i] * inv);
        __syncthreads();
    }
    const int half = hd / 2;
    const float* c = cos_t + (long long)tok.rope_pos * half;
    const float* s = sin_t + (long long)tok.rope_pos * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float x1 = h[i], x2 = h[i + half];
        const float a = x1 * c[i] - x2 * s[i];
        const float b = x2 * c[i] + x1 * s[i];
        if (is_q) {
            float* dst = q + (long long)t * heads * hd + y * hd;
            dst[i] = a;
            dst[i + half] = b;
        } else if constexpr (BITS > 0) {
            h[i] = a;  // this thread alone reads and writes elements i and i + half
            h[i + half] = b;
        } else {
            const long long at = slot * kvd + (y - heads) * hd;
            KvIo<KV>::put(kbuf, at + i, a);
            KvIo<KV>::put(kbuf, at + i + half, b);
        }
    }
    if constexpr (BITS > 0) {
        if (is_q) return;  // uniform across the block
        __syncthreads();
        quantize_head<BITS>(h, hd, &kbuf[(slot * kv_heads + (y - heads)) * units].w, part);
    }
}

#define QK_ARGS                                                                                                  \
    float *q, const float *k, const float *v, const float *q_norm, const float *k_norm, float eps,               \
        const float *cos_t, const float *sin_t, const Tok *toks, const RowKv *rows, int layer, int heads,         \
        int kv_heads, int hd
#define QK_PASS q, k, v, q_norm, k_norm, eps, cos_t, sin_t, toks, rows, layer, heads, kv_heads, hd
extern "C" __global__ void qk_rope_store_f32(QK_ARGS) { qk_rope_store_impl<float>(QK_PASS); }
extern "C" __global__ void qk_rope_store_bf16(QK_ARGS) { qk_rope_store_impl<u16>(QK_PASS); }
extern "C" __global__ void qk_rope_store_q8(QK_ARGS) { qk_rope_store_impl<QKv<8>>(QK_PASS); }
extern "C" __global__ void qk_rope_store_q4(QK_ARGS) { qk_rope_store_impl<QKv<4>>(QK_PASS); }

// ---------------------------------------------------------------------------------------
// Attention. The query at logical position p reads keys [0, p] of its own row ((p - window,
// p] with a window) in one fixed order, set by positions alone (never by the batch):
//   - keys are cut into segments of ATT_SEG (512) anchored at position 0, each segment into
//     chunks of 32, chunk c (keys 32c..32c+31) taken by warp c % ATT_WARPS of a block;
//   - in a chunk lane j scores key 32c + j (dot product in increasing d), the chunk's
//     maximum and sum come from the butterfly, and each output dim accumulates over the
//     chunk's keys in order (an online softmax over the warp's chunks in increasing c);
//     lane j keeps dims [j P, j P + P) (P = MAX_HD / 32), read with one vector load a key;
//   - a segment's state is its warps' states merged in warp order, the query's state its
//     segments' states merged in segment order (empty ones skipped), then normalised.
// A block serves G query heads of one KV head (GQA): each key and value it loads feeds the
// G heads, each head's arithmetic exactly as when alone (G is fixed by the model's shape).
// Two launches compute the same bits: a block per (token, head group) walking the segments
// in order (`partial` null: prefill), or a block per (token, head group, segment) writing
// each head's segment state to `partial` and `attention_merge` merging them (few tokens at
// long context, where one block per group would leave the GPU idle).
// `splits` > 1 is the negative control only: warp 0 alone cuts the keys into that many
// segments, each with its own online softmax, merged at the end (a split count chosen from
// the batch changes the bits, which the invariance tests must catch).
// grid: (tokens, heads / G) or (tokens, heads / G * segments), block: 32 ATT_WARPS.
// Requires hd <= MAX_HD (256, or 512 for Gemma 4's global layers: a variant with twice the
// registers, picked by head size alone) and G to divide the heads per KV head.
#define ATT_WARPS 8
#define ATT_SEG 512
// Two blocks per SM: at most 128 registers a thread (the 512 variant spills a little).
#define ATT_MIN_BLOCKS 2

// One online-softmax state: running maximum, sum and output accumulators (this lane's
// P = MAX_HD / 32 dims).
template <int MAX_HD>
struct Online {
    float m, l, acc[MAX_HD / 32];
    __device__ void clear() {
        m = __int_as_float(0xff800000);
        l = 0.0f;
#pragma unroll
        for (int d = 0; d < MAX_HD / 32; d++) acc[d] = 0.0f;
    }
    // Adds the state (m2, l2, acc2) of later keys: taken as is into an empty state, else
    // both scaled to the larger maximum (explicit roundings: every launch that merges gets
    // the same bits). A state without keys (l2 == 0) adds nothing.
    __device__ void add(float m2, float l2, const float* acc2) {
        if (l2 == 0.0f) return;
        if (l == 0.0f) {
            m = m2;
            l = l2;
#pragma unroll
            for (int d = 0; d < MAX_HD / 32; d++) acc[d] = acc2[d];
            return;
        }
        const float nm = fmaxf(m, m2);
        const float a = expf(m - nm), b = expf(m2 - nm);
        l = fmaf(l2, b, __fmul_rn(l, a));
#pragma unroll
        for (int d = 0; d < MAX_HD / 32; d++) acc[d] = fmaf(acc2[d], b, __fmul_rn(acc[d], a));
        m = nm;
    }
};

// P consecutive K/V elements (one lane's dims of a value row) as the 32-bit words they sit
// in, widened only at their FMA (widening at the load made each load wait for the one
// before).
template <class KV, int P>
struct Dims {
    static constexpr int W = P * (int)sizeof(KV) / 4;
    u32 w[W];
    __device__ __forceinline__ float get(int i) const {
        if constexpr (sizeof(KV) == 4) return __uint_as_float(w[i]);
        else return __uint_as_float(i & 1 ? w[i / 2] & 0xffff0000u : w[i / 2] << 16);  // bf16: exact
    }
};

// The same for quantized K/V: the P codes (packed as stored) and their group's scale and bias.
template <int B, int P>
struct Dims<QKv<B>, P> {
    static constexpr int W = (P * B + 31) / 32;
    u32 w[W];
    float scale, bias;
    __device__ __forceinline__ float get(int i) const {
        return dequantize(scale, bias, (w[i * B / 32] >> (i * B % 32)) & ((1u << B) - 1));
    }
};

// Lane `lane`'s P dims of the value row at `v` (hd elements): vector loads when hd is a
// multiple of P (VEC), else an element each; dims past hd are clamped into the row (loaded,
// never used), so every load is in bounds and none is conditional.
template <class KV, int P, bool VEC>
__device__ __forceinline__ Dims<KV, P> lane_dims(const KV* v, int hd, int lane) {
    Dims<KV, P> r;
    if constexpr (KvIo<KV>::BITS > 0) {
        // Quantized: the group's scale and bias, then the lane's codes (P * B bits from a
        // multiple of P codes: 16 bits at P = 4, B = 4; else whole words).
        constexpr int B = KvIo<KV>::BITS;
        const u32* g = &v->w;
        r.scale = __uint_as_float(g[0]);
        r.bias = __uint_as_float(g[1]);
        if constexpr (VEC) {
            const int e0 = min(lane * P, hd - P);
            if constexpr (P * B == 16) {
                r.w[0] = reinterpret_cast<const u16*>(g + 2)[e0 / 4];
            } else {
#pragma unroll
                for (int i = 0; i < Dims<KV, P>::W; i++) r.w[i] = g[2 + e0 * B / 32 + i];
            }
        } else {
#pragma unroll
            for (int i = 0; i < Dims<KV, P>::W; i++) r.w[i] = 0;
#pragma unroll
            for (int i = 0; i < P; i++) {
                const int e = min(lane * P + i, hd - 1);
                const u32 code = (g[2 + e * B / 32] >> (e * B % 32)) & ((1u << B) - 1);
                r.w[i * B / 32] |= code << (i * B % 32);
            }
        }
    } else if constexpr (VEC) {
        const KV* at = v + min(lane * P, hd - P);
        // volatile: issued here, ahead of the FMAs (a plain load was moved down to its use).
        if constexpr (Dims<KV, P>::W == 2) {
            asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(at));
        } else {
#pragma unroll
            for (int i = 0; i < Dims<KV, P>::W; i += 4)
                asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(r.w[i]), "=r"(r.w[i + 1]), "=r"(r.w[i + 2]), "=r"(r.w[i + 3])
                             : "l"(at + i * 4 / (int)sizeof(KV)));
        }
    } else {
#pragma unroll
        for (int i = 0; i < Dims<KV, P>::W; i++) r.w[i] = 0;
#pragma unroll
        for (int i = 0; i < P; i++) {
            const KV e = v[min(lane * P + i, hd - 1)];
            if constexpr (sizeof(KV) == 4) r.w[i] = __float_as_uint(e);
            else r.w[i / 2] |= (u32)e << (16 * (i & 1));
        }
    }
    return r;
}

// The values of keys c0 + jb .. c0 + jb + VB - 1 weighted by lane j's `pj[g]` (key c0 + j's
// probability under head g) into `st[g]`: the VB loads first, then the FMAs in key order
// (the order of one key at a time). No condition between them: the compiler then keeps the
// loads ahead (behind a `break` it moved each load down to its FMAs, one latency a key).
template <class KV, int MAX_HD, int G, bool VEC, int VB>
__device__ __forceinline__ void attend_values(Online<MAX_HD>* st, const float* pj, long long slot, int jb,
                                              const KV* vbuf, int kvd, int hd, int lane) {
    constexpr int P = MAX_HD / 32;
    Dims<KV, P> raw[VB];
#pragma unroll
    for (int u = 0; u < VB; u++)
        raw[u] = lane_dims<KV, P, VEC>(vbuf + __shfl_sync(0xffffffffu, slot, jb + u) * kvd, hd, lane);
#pragma unroll
    for (int u = 0; u < VB; u++) {
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float pb = __shfl_sync(0xffffffffu, pj[g], jb + u);
#pragma unroll
            for (int d = 0; d < P; d++) st[g].acc[d] = fmaf(pb, raw[u].get(d), st[g].acc[d]);
        }
    }
}

// Keys c0 + j0 .. c0 + n - 1 in blocks of VB keys, then VB / 2, ..., 1 for the rest.
template <class KV, int MAX_HD, int G, bool VEC, int VB>
__device__ __forceinline__ void attend_values_from(Online<MAX_HD>* st, const float* pj, long long slot, int j0,
                                                   int n, const KV* vbuf, int kvd, int hd, int lane) {
    int jb = j0;
    for (; jb + VB <= n; jb += VB) attend_values<KV, MAX_HD, G, VEC, VB>(st, pj, slot, jb, vbuf, kvd, hd, lane);
    if constexpr (VB > 1) attend_values_from<KV, MAX_HD, G, VEC, VB / 2>(st, pj, slot, jb, n, vbuf, kvd, hd, lane);
}

// Keys [max(c0, k0), min(c0 + 32, k1)) of the chunk at c0 into `st[g]` for the G heads
// whose queries sit at qs + g MAX_HD (one warp).
template <class KV, int MAX_HD, int G>
__device__ void attend_chunk(Online<MAX_HD>* st, int c0, int k0, int k1, const float* qs, const KV* kbuf,
                             const KV* vbuf, const RowKv& row, int kvd, int hd, float scale, int lane) {
    constexpr int P = MAX_HD / 32;
    const int p = c0 + lane;
    const bool valid = p >= k0 && p < k1;
    long long slot = 0;
    float sc[G];
#pragma unroll
    for (int g = 0; g < G; g++) sc[g] = __int_as_float(0xff800000);
    if (valid) {
        slot = kv_slot(row, p);
        const long long at = slot * kvd;
        float dot[G];
#pragma unroll
        for (int g = 0; g < G; g++) dot[g] = 0.0f;
        if ((hd & 7) == 0) {
            // The same order, 8 elements per load.
#pragma unroll 4
            for (int d = 0; d < hd; d += 8) {
                float kv[8];
                KvIo<KV>::get8(kbuf, at, d, kv);
#pragma unroll
                for (int g = 0; g < G; g++)
#pragma unroll
                    for (int j = 0; j < 8; j++) dot[g] = fmaf(qs[g * MAX_HD + d + j], kv[j], dot[g]);
            }
        } else {
            for (int d = 0; d < hd; d++) {
                const float k = KvIo<KV>::get(kbuf, at, d);
#pragma unroll
                for (int g = 0; g < G; g++) dot[g] = fmaf(qs[g * MAX_HD + d], k, dot[g]);
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = __fmul_rn(dot[g], scale);
    }
    float pj[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float m_new = fmaxf(st[g].m, warp_max(sc[g]));
        if (m_new > st[g].m) {
            const float alpha = expf(st[g].m - m_new);
            st[g].l = __fmul_rn(st[g].l, alpha);
#pragma unroll
            for (int d = 0; d < P; d++) st[g].acc[d] = __fmul_rn(st[g].acc[d], alpha);
            st[g].m = m_new;
        }
        pj[g] = valid ? expf(sc[g] - st[g].m) : 0.0f;
        st[g].l = __fadd_rn(st[g].l, warp_sum(pj[g]));
    }
    const int j0 = max(k0 - c0, 0), n = min(32, k1 - c0);
    // Keys loaded ahead: as many as registers allow (one at a time off the vector loads: rare).
    constexpr int VB = P <= 4 ? 8 : P <= 8 ? 4 : 1;
    if (hd % P == 0) attend_values_from<KV, MAX_HD, G, true, VB>(st, pj, slot, j0, n, vbuf, kvd, hd, lane);
    else attend_values_from<KV, MAX_HD, G, false, 1>(st, pj, slot, j0, n, vbuf, kvd, hd, lane);
}

// The block's shared scratch for one head: each warp's state.
template <int MAX_HD>
struct WarpStates {
    float m[ATT_WARPS], l[ATT_WARPS], acc[ATT_WARPS][MAX_HD];
};

// Segment `seg`'s state of keys [first, n_keys) for the block's G heads: head g's in warp
// g's `out` (the whole block calls; warps from G on get nothing).
template <class KV, int MAX_HD, int G>
__device__ void segment_state(Online<MAX_HD>& out, WarpStates<MAX_HD>* ws, int seg, int first, int n_keys,
                              const float* qs, const KV* kbuf, const KV* vbuf, const RowKv& row, int kvd,
                              int hd, float scale) {
    constexpr int P = MAX_HD / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Online<MAX_HD> st[G];
#pragma unroll
    for (int g = 0; g < G; g++) st[g].clear();
    const int lo = max(first, seg * ATT_SEG), hi = min(n_keys, (seg + 1) * ATT_SEG);
    if (lo < hi) {
        // This warp's chunks of the segment: c = warp (mod ATT_WARPS).
        const int c_first = lo / 32;
        const int c_start = c_first + ((warp - c_first) % ATT_WARPS + ATT_WARPS) % ATT_WARPS;
        for (int c = c_start; 32 * c < hi; c += ATT_WARPS)
            attend_chunk<KV, MAX_HD, G>(st, 32 * c, first, n_keys, qs, kbuf, vbuf, row, kvd, hd, scale, lane);
    }
    __syncthreads();  // the merging warps are done reading the previous segment's states
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            ws[g].m[warp] = st[g].m;
            ws[g].l[warp] = st[g].l;
        }
#pragma unroll
        for (int d = 0; d < P; d++) ws[g].acc[warp][lane * P + d] = st[g].acc[d];
    }
    __syncthreads();
    if (warp >= G) return;
    out.clear();
    for (int v = 0; v < ATT_WARPS; v++) {
        float a[P];
#pragma unroll
        for (int d = 0; d < P; d++) a[d] = ws[warp].acc[v][lane * P + d];
        out.add(ws[warp].m[v], ws[warp].l[v], a);
    }
}

// Writes the normalised output of `st` (one warp's lanes, each its P dims).
template <int MAX_HD>
__device__ void write_output(const Online<MAX_HD>& st, float* o, int hd, int lane) {
    constexpr int P = MAX_HD / 32;
    const float inv = 1.0f / st.l;
#pragma unroll
    for (int d = 0; d < P; d++) {
        const int dd = lane * P + d;
        if (dd < hd) o[dd] = __fmul_rn(st.acc[d], inv);
    }
}

template <class KV, int MAX_HD, int G>
__device__ void attention_impl(const float* q, float* out, float* partial, const Tok* toks, const RowKv* rows,
                               int layer, int heads, int kv_heads, int hd, float scale, int splits, int window) {
    constexpr int P = MAX_HD / 32;
    __shared__ float qs[G * MAX_HD];
    __shared__ WarpStates<MAX_HD> ws[G];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = heads / G;
    const int head0 = (blockIdx.y % groups) * G, seg = blockIdx.y / groups;
    const int max_segs = gridDim.y / groups;
    const Tok tok = toks[t];
    const RowKv row = rows[tok.row];
    const int units = KvIo<KV>::units(hd);  // a head's K/V in the store's steps
    const int kvd = kv_heads * units;
    const int kvh = head0 / (heads / kv_heads);
    const KV* kbuf = reinterpret_cast<const KV*>(row.base) + (long long)(2 * layer) * row.plane + kvh * units;
    const KV* vbuf = reinterpret_cast<const KV*>(row.base) + (long long)(2 * layer + 1) * row.plane + kvh * units;
    const float* qh = q + ((long long)t * heads + head0) * hd;
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i / hd * MAX_HD + i % hd] = qh[i];
    __syncthreads();
    const int n_keys = tok.pos + 1;
    const int first = max(tok.first, window > 0 ? n_keys - window : 0);
    if (splits > 1) {
        if (warp != 0) return;
        for (int g = 0; g < G; g++) {
            Online<MAX_HD> tot;
            tot.clear();
            for (int sp = 0; sp < splits; sp++) {
                const int span = n_keys - first;
                const int k0 = first + (int)((long long)span * sp / splits);
                const int k1 = first + (int)((long long)span * (sp + 1) / splits);
                if (k1 <= k0) continue;
                Online<MAX_HD> part;
                part.clear();
                for (int c0 = k0; c0 < k1; c0 += 32)
                    attend_chunk<KV, MAX_HD, 1>(&part, c0, k0, k1, qs + g * MAX_HD, kbuf, vbuf, row, kvd, hd,
                                                scale, lane);
                tot.add(part.m, part.l, part.acc);
            }
            write_output(tot, out + ((long long)t * heads + head0 + g) * hd, hd, lane);
        }
        return;
    }
    // Warp g < G ends with head head0 + g's state.
    Online<MAX_HD> tot;
    tot.clear();
    if (partial) {
        // This block's segment alone, each head's state stored for attention_merge (l = 0: no keys).
        segment_state<KV, MAX_HD, G>(tot, ws, seg, first, n_keys, qs, kbuf, vbuf, row, kvd, hd, scale);
        if (warp >= G) return;
        float* dst = partial + (((long long)t * heads + head0 + warp) * max_segs + seg) * (hd + 2);
        if (lane == 0) {
            dst[0] = tot.m;
            dst[1] = tot.l;
        }
#pragma unroll
        for (int d = 0; d < P; d++)
            if (lane * P + d < hd) dst[2 + lane * P + d] = tot.acc[d];
        return;
    }
    for (int s = first / ATT_SEG; s * ATT_SEG < n_keys; s++) {
        Online<MAX_HD> st;
        segment_state<KV, MAX_HD, G>(st, ws, s, first, n_keys, qs, kbuf, vbuf, row, kvd, hd, scale);
        if (warp < G) tot.add(st.m, st.l, st.acc);
    }
    if (warp < G) write_output(tot, out + ((long long)t * heads + head0 + warp) * hd, hd, lane);
}

#define ATT_ARGS                                                                                                 \
    const float *q, float *out, float *partial, const Tok *toks, const RowKv *rows, int layer, int heads,        \
        int kv_heads, int hd, float scale, int splits, int window
#define ATT_PASS q, out, partial, toks, rows, layer, heads, kv_heads, hd, scale, splits, window
#define ATT_KERNEL(name, KV, MAX_HD, G)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, ATT_MIN_BLOCKS) name(ATT_ARGS) { \
        attention_impl<KV, MAX_HD, G>(ATT_PASS);                                                    \
    }
// Head size 128 serves 1, 2 or 4 query heads a block (the most that divides the group).
ATT_KERNEL(attention_f32_128, float, 128, 1)
ATT_KERNEL(attention_bf16_128, u16, 128, 1)
ATT_KERNEL(attention_f32_128_g2, float, 128, 2)
ATT_KERNEL(attention_bf16_128_g2, u16, 128, 2)
ATT_KERNEL(attention_f32_128_g4, float, 128, 4)
ATT_KERNEL(attention_bf16_128_g4, u16, 128, 4)
ATT_KERNEL(attention_f32_256, float, 256, 1)
ATT_KERNEL(attention_bf16_256, u16, 256, 1)
ATT_KERNEL(attention_f32_512, float, 512, 1)
ATT_KERNEL(attention_bf16_512, u16, 512, 1)
ATT_KERNEL(attention_q8_128, QKv<8>, 128, 1)
ATT_KERNEL(attention_q4_128, QKv<4>, 128, 1)
ATT_KERNEL(attention_q8_128_g2, QKv<8>, 128, 2)
ATT_KERNEL(attention_q4_128_g2, QKv<4>, 128, 2)
ATT_KERNEL(attention_q8_128_g4, QKv<8>, 128, 4)
ATT_KERNEL(attention_q4_128_g4, QKv<4>, 128, 4)
ATT_KERNEL(attention_q8_256, QKv<8>, 256, 1)
ATT_KERNEL(attention_q4_256, QKv<4>, 256, 1)
ATT_KERNEL(attention_q8_512, QKv<8>, 512, 1)
ATT_KERNEL(attention_q4_512, QKv<4>, 512, 1)

// Merges the segments' states that `attention` stored in `partial` (tokens x heads x
// max_segs states of hd + 2 floats), in segment order, as the one-block launch does.
// grid: (tokens, heads), block: 32.
extern "C" __global__ void attention_merge(const float* partial, float* out, int heads, int hd, int max_segs) {
    const int t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const float* src = partial + ((long long)t * heads + head) * max_segs * (hd + 2);
    Online<512> tot;
    tot.clear();
    // MERGE_AHEAD segments' states loaded before any of them is added (the adds stay in
    // segment order): a 32k-key query's 64 segments in 16 rounds of loads, not 64.
    constexpr int MERGE_AHEAD = 4;
    for (int s0 = 0; s0 < max_segs; s0 += MERGE_AHEAD) {
        float mm[MERGE_AHEAD], ll[MERGE_AHEAD], a[MERGE_AHEAD][16];
#pragma unroll
        for (int u = 0; u < MERGE_AHEAD; u++) {
            const float* p = src + (long long)min(s0 + u, max_segs - 1) * (hd + 2);
            mm[u] = p[0];
            ll[u] = p[1];
#pragma unroll
            for (int d = 0; d < 16; d++) a[u][d] = lane + 32 * d < hd ? p[2 + lane + 32 * d] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < MERGE_AHEAD; u++)
            if (s0 + u < max_segs) tot.add(mm[u], ll[u], a[u]);
    }
    // Lane j keeps dims j + 32 d here (each dim's adds are the same whichever lane does them).
    float* o = out + ((long long)t * heads + head) * hd;
    const float inv = 1.0f / tot.l;
#pragma unroll
    for (int d = 0; d < 16; d++)
        if (lane + 32 * d < hd) o[lane + 32 * d] = __fmul_rn(tot.acc[d], inv);
}

// ---------------------------------------------------------------------------------------
// KV store maintenance on raw units (4-byte words for f32 and quantized K/V, 2-byte for
// bf16).
//
// Moves slots [from, from + n) down to [to, to + n) of every plane (to < from, the ranges
// may overlap): one block per plane walks forward in chunks, all reads of a chunk before
// any write; writes land below every element not yet read. grid: planes, block: 256.
template <class E>
__device__ void kv_move_impl(E* base, long long plane, long long from, long long to, long long n) {
    E* p = base + (long long)blockIdx.x * plane;
    for (long long c = 0; c < n; c += blockDim.x) {
        const long long i = c + threadIdx.x;
        E v = i < n ? p[from + i] : E(0);
        __syncthreads();
        if (i < n) p[to + i] = v;
        __syncthreads();
    }
}
extern "C" __global__ void kv_move_4(u32* b, long long plane, long long from, long long to, long long n) {
    kv_move_impl<u32>(b, plane, from, to, n);
}
extern "C" __global__ void kv_move_2(u16* b, long long plane, long long from, long long to, long long n) {
    kv_move_impl<u16>(b, plane, from, to, n);
}

// Copies the first n elements of every plane from src (planes of src_plane elements) to
// dst (planes of dst_plane) and zeroes dst elements [zero_from, zero_to) (src may be dst
// when n is 0). grid: (blocks, planes).
template <class E>
__device__ void kv_copy_impl(const E* src, long long src_plane, E* dst, long long dst_plane, long long n,
                             long long zero_from, long long zero_to) {
    const E* s = src + (long long)blockIdx.y * src_plane;
    E* d = dst + (long long)blockIdx.y * dst_plane;
    const long long work = n + (zero_to > zero_from ? zero_to - zero_from : 0);
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < work;
         j += (long long)gridDim.x * blockDim.x) {
        if (j < n)
            d[j] = s[j];
        else
            d[zero_from + (j - n)] = E(0);
    }
}
extern "C" __global__ void kv_copy_4(const u32* s, long long sp, u32* d, long long dp, long long n, long long z0,
                                     long long z1) {
    kv_copy_impl<u32>(s, sp, d, dp, n, z0, z1);
}
extern "C" __global__ void kv_copy_2(const u16* s, long long sp, u16* d, long long dp, long long n, long long z0,
                                     long long z1) {
    kv_copy_impl<u16>(s, sp, d, dp, n, z0, z1);
}

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

// ---------------------------------------------------------------------------------------
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

// Attention on the tensor cores (bf16 activations and K/V).
#include "flash.cuh"

FLASH_KERNEL(flash_attention_32, 32, false, FaMmaSync)
FLASH_KERNEL(flash_attention_64, 64, false, FaMmaSync)
FLASH_KERNEL(flash_attention_128, 128, false, FaMmaSync)
FLASH_KERNEL(flash_attention_32_full, 32, true, FaMmaSync)
FLASH_KERNEL(flash_attention_64_full, 64, true, FaMmaSync)
FLASH_KERNEL(flash_attention_128_full, 128, true, FaMmaSync)

// Merges the segment states `flash_attention` stored in `partial` (tokens x heads x max_segs
// states of hd + 2 floats), in segment order, with `fa_merge`; lane j
// keeps dims j + 32 i. grid: (tokens, heads), block: 32.
extern "C" __global__ void flash_merge(const float* partial, float* out, int heads, int hd, int max_segs) {
    const int t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const float* src = partial + ((long long)t * heads + head) * max_segs * (hd + 2);
    float m = __int_as_float(0xff800000), l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < max_segs; s++) {
        const float* p = src + (long long)s * (hd + 2);
        float a[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = lane + 32 * i < hd ? p[2 + lane + 32 * i] : 0.0f;
        fa_merge<4>(m, l, acc, p[0], p[1], a);
    }
    float* o = out + ((long long)t * heads + head) * hd;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (lane + 32 * i < hd) o[lane + 32 * i] = __fmul_rn(acc[i], inv);
}
