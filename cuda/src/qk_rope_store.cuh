// Quantized K/V's format (`QKv`, `KvIo`: shared with attention) and `qk_rope_store`: q/k
// norms, RoPE and the K/V write into the rows' blocks. Host side: `Kernels::qk_rope_store`
// (lib.rs) and forward.rs (the rows' layout). Part of kernels.cu's one compilation unit
// (included in order).

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
