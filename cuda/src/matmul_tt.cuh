// The tiled tensor-core matmul for many tokens (`linear_tt*`), the activation splits it and
// wgmma read (`split_activations*`) and the phase merges (`linear_merge_phases*`). Host side:
// matmul_tt.rs. Part of kernels.cu's one compilation unit (included in order, after
// matmul_tc.cuh).

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
