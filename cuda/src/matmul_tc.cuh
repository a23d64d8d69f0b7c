// The tensor-core matmul's pass kernels for bf16 weights (`linear_tc*`: one or several
// weights a launch, SwiGLU's gate and up) and the MMA helpers the other tensor-core kernels
// share (`split3`, `mma_bf16`, `silu_mul`, ...). Host side: matmul_tc.rs. Part of
// kernels.cu's one compilation unit (included in order).

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
