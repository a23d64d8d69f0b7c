// MLX-quantized weights on the tensor cores, bf16 activations (`prep_q_acts`, `linear_tcq*`).
// Host side: matmul_tcq.rs. Part of kernels.cu's one compilation unit (included in order,
// after matmul_tc.cuh, whose MMA helpers it uses).

// MLX-quantized weights on the tensor cores, bf16 activations (affine 4- or 8-bit codes,
// groups of 32, 64 or 128, bf16 scales and biases: what `mlx_lm.convert -q` writes for a
// bf16 model). The codes are exact in bf16, so per group the MMAs sum bf16(x) * code from
// zero (dot) and the group then adds scale * dot + c * xsum to the output, xsum the sum of
// the group's bf16(x): acc = acc + fma(scale, dot, c * xsum), each op rounded once. 4-bit
// codes enter the MMAs as bf16 128 + q (one lop3 makes two from the packed word), so
// c = fma(-128, scale, bias); 8-bit codes enter as q, c = bias. `sb`: one word per
// (row, group), the scale's bf16 bits low, the bias's high.
//
// The codes come repacked at upload (`repack_codes` in matmul_tcq.rs): in each row's chunk of 128
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
