// Row-invariant Metal kernels (design.md, "Rules for every kernel"), the Metal twin of
// ../cuda/kernels.cu.
//
// Every reduction has one order that depends only on the reduced length and fixed
// constants (a SIMD-group of 32 lanes reduced by an explicit xor butterfly, 8 elements per
// lane per step, key chunks of 32 anchored at position 0), never on how many tokens or
// rows share a dispatch. Activations are f32; weights are read in their checkpoint dtype
// and widened in registers; K/V are stored in the model's KV dtype (f32, bf16, or 8- or
// 4-bit codes in the CPU's format, `QKv`: quantized on store, dequantized on load). Built
// with fast math off (apple.rs): every row runs the same instructions in any batch anyway,
// and a multiply then an add written as two statements stay two roundings.
//
// Conventions the Rust side (lib.rs) and the emulator rely on, checked by
// tests/metal_source.rs: buffer indices run 0, 1, 2, .. in parameter order; the only
// built-ins are `uint2 group [[threadgroup_position_in_grid]]` and
// `uint tid [[thread_index_in_threadgroup]]`, last; threadgroups are 1-D and a multiple of
// 32 threads, so SIMD-group lane = tid % 32 (Apple GPUs run 32-wide SIMD-groups).
// Optional inputs come with a flag (a nil binding is not a null pointer).

#include <metal_stdlib>
using namespace metal;

inline float bf16_to_f32(ushort b) { return as_type<float>(uint(b) << 16); }
inline float f16_to_f32(ushort h) { return float(as_type<half>(h)); }
// Round to nearest even (the conversion torch and the CPU code use).
inline ushort f32_to_bf16(float f) {
    uint u = as_type<uint>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return ushort(u >> 16);
}

// The one SIMD-group reduction: xor butterfly 16, 8, 4, 2, 1. Float addition is
// commutative, so every lane ends with the same bits.
inline float simd_sum_fixed(float v) {
    for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
    return v;
}
// Four independent sums at once (each element's order as above).
inline float4 simd_sum_fixed(float4 v) {
    for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
    return v;
}
inline float simd_max_fixed(float v) {
    for (ushort o = 16; o > 0; o >>= 1) v = fmax(v, simd_shuffle_xor(v, o));
    return v;
}
inline float simd_min_fixed(float v) {
    for (ushort o = 16; o > 0; o >>= 1) v = fmin(v, simd_shuffle_xor(v, o));
    return v;
}

// Weight readers: element i (flat, row-major) widened to f32.
struct F32W {
    device const float* p;
    float get(ulong i) const { return p[i]; }
};
struct Bf16W {
    device const ushort* p;
    float get(ulong i) const { return bf16_to_f32(p[i]); }
};
struct F16W {
    device const ushort* p;
    float get(ulong i) const { return f16_to_f32(p[i]); }
};
// The 16 FP4 (E2M1) values of mxfp4: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constant float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// MLX quantization: value i of a row-major rows x k matrix (g = i / group), codes packed
// 32 / BITS to a u32 from the low bits up. Affine: scale[g] * q + bias[g], a multiply then
// an add (never fused). mxfp4 (no biases): scale[g] * e2m1(q), exact.
template <int BITS>
struct QW {
    device const uint* q;
    device const float* scale;
    device const float* bias;
    int has_bias;
    int group;
    float get(ulong i) const {
        const uint per = 32 / BITS;
        const uint w = q[i / per];
        const uint code = (w >> (uint(i % per) * BITS)) & ((1u << BITS) - 1u);
        const ulong g = i / ulong(group);
        if (has_bias == 0) return scale[g] * E2M1[code & 15u];
        const float scaled = scale[g] * float(code);
        return scaled + bias[g];
    }
};

// ---------------------------------------------------------------------------------------
// Matmul: out[r, c] (+)= dot(x[r, :], w[c, :]) + bias[c].
//
// One SIMD-group owns NC output columns for every row. Canonical order of one output:
// lane L accumulates, with fused multiply-adds in increasing k, the elements
// k = 256 i + 8 L + j (i = 0, 1, ..; j = 0..7); then the butterfly. Rows are processed MB
// at a time only to reuse weights from registers (MB = 4, 8 or 16, picked from M by the
// host); the order of an output never depends on M, on MB or on the other rows. No split-K.
// grid: ceil(n / 16), threadgroup: 128 (4 SIMD-groups of NC = 4 columns).
#define NC 4  // one float4 butterfly reduces a row's NC outputs
#define SIMDS 4

template <class W, int MB>
void linear_impl(device const float* x, int m, int k, W w, int n, device const float* bias, int has_bias,
                 device float* out, int accumulate, uint group, uint tid) {
    const int lane = int(tid & 31u);
    const int c0 = (int(group) * SIMDS + int(tid >> 5)) * NC;
    if (c0 >= n) return;  // the whole SIMD-group
    for (int r0 = 0; r0 < m; r0 += MB) {
        float acc[MB][NC];
        for (int a = 0; a < MB; a++)
            for (int c = 0; c < NC; c++) acc[a][c] = 0.0f;
        for (int kb = lane * 8; kb < k; kb += 256) {
            float wv[NC][8];
            for (int c = 0; c < NC; c++) {
                const ulong at = ulong(min(c0 + c, n - 1)) * ulong(k) + ulong(kb);
                for (int j = 0; j < 8; j++) wv[c][j] = kb + j < k ? w.get(at + ulong(j)) : 0.0f;
            }
            for (int a = 0; a < MB; a++) {
                const int r = r0 + a;
                if (r >= m) break;
                device const float* xr = x + ulong(r) * ulong(k) + ulong(kb);
                float xv[8];
                for (int j = 0; j < 8; j++) xv[j] = kb + j < k ? xr[j] : 0.0f;
                for (int c = 0; c < NC; c++)
                    for (int j = 0; j < 8; j++) acc[a][c] = fma(xv[j], wv[c][j], acc[a][c]);
            }
        }
        for (int a = 0; a < MB; a++) {
            const int r = r0 + a;
            if (r >= m) break;
            const float4 s = simd_sum_fixed(float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]));
            const int col = c0 + lane;
            if (lane < NC && col < n) {
                float y = s[lane];
                if (has_bias != 0) y += bias[col];
                device float* o = out + ulong(r) * ulong(n) + ulong(col);
                *o = accumulate != 0 ? *o + y : y;
            }
        }
    }
}

#define LINEAR(NAME, W, T, MB)                                                                              \
    kernel void NAME(device const float* x [[buffer(0)]], constant int& m [[buffer(1)]],                    \
                     constant int& k [[buffer(2)]], device const T* w [[buffer(3)]],                        \
                     constant int& n [[buffer(4)]], device const float* bias [[buffer(5)]],                 \
                     constant int& has_bias [[buffer(6)]], device float* out [[buffer(7)]],                 \
                     constant int& accumulate [[buffer(8)]], uint2 group [[threadgroup_position_in_grid]],  \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        linear_impl<W, MB>(x, m, k, W{w}, n, bias, has_bias, out, accumulate, group.x, tid);                \
    }
LINEAR(linear_f32_4, F32W, float, 4)
LINEAR(linear_f32_8, F32W, float, 8)
LINEAR(linear_f32_16, F32W, float, 16)
LINEAR(linear_bf16_4, Bf16W, ushort, 4)
LINEAR(linear_bf16_8, Bf16W, ushort, 8)
LINEAR(linear_bf16_16, Bf16W, ushort, 16)
LINEAR(linear_f16_4, F16W, ushort, 4)
LINEAR(linear_f16_8, F16W, ushort, 8)
LINEAR(linear_f16_16, F16W, ushort, 16)

#define LINEAR_Q(NAME, BITS, MB)                                                                            \
    kernel void NAME(device const float* x [[buffer(0)]], constant int& m [[buffer(1)]],                    \
                     constant int& k [[buffer(2)]], device const uint* q [[buffer(3)]],                     \
                     device const float* scale [[buffer(4)]], device const float* qbias [[buffer(5)]],      \
                     constant int& has_qbias [[buffer(6)]], constant int& qgroup [[buffer(7)]],             \
                     constant int& n [[buffer(8)]], device const float* bias [[buffer(9)]],                 \
                     constant int& has_bias [[buffer(10)]], device float* out [[buffer(11)]],               \
                     constant int& accumulate [[buffer(12)]], uint2 group [[threadgroup_position_in_grid]], \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        linear_impl<QW<BITS>, MB>(x, m, k, QW<BITS>{q, scale, qbias, has_qbias, qgroup}, n, bias, has_bias,  \
                                  out, accumulate, group.x, tid);                                           \
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

// The negative control's matmul (never used by the library): like a stock kernel that
// picks its split-K from the shape, K is cut into 1 + M % 4 segments summed at the end, so
// a row's bits depend on M. f32 weights (the host widens). grid: ceil(n / 16), 128 threads.
kernel void linear_split_k(device const float* x [[buffer(0)]], constant int& m [[buffer(1)]],
                           constant int& k [[buffer(2)]], device const float* w [[buffer(3)]],
                           constant int& n [[buffer(4)]], device float* out [[buffer(5)]],
                           uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    const int col = int(group.x) * 16 + int(tid >> 3);
    const int part = int(tid & 7u);
    if (col >= n) return;
    const int splits = 1 + m % 4;
    for (int r = part; r < m; r += 8) {
        float total = 0.0f;
        for (int s = 0; s < splits; s++) {
            const int k0 = k * s / splits, k1 = k * (s + 1) / splits;
            float acc = 0.0f;
            for (int i = k0; i < k1; i++) acc = fma(x[ulong(r) * ulong(k) + ulong(i)], w[ulong(col) * ulong(k) + ulong(i)], acc);
            total += acc;
        }
        out[ulong(r) * ulong(n) + ulong(col)] = total;
    }
}

// ---------------------------------------------------------------------------------------
// Embedding rows widened to f32. grid: tokens, threadgroup: 256.
template <class W>
void embed_impl(W table, device const uint* tokens, int cols, device float* out, uint group, uint tid) {
    const ulong row = ulong(tokens[group]) * ulong(cols);
    for (int c = int(tid); c < cols; c += 256) out[ulong(group) * ulong(cols) + ulong(c)] = table.get(row + ulong(c));
}
#define EMBED(NAME, W, T)                                                                                   \
    kernel void NAME(device const T* t [[buffer(0)]], device const uint* tok [[buffer(1)]],                 \
                     constant int& cols [[buffer(2)]], device float* out [[buffer(3)]],                     \
                     uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) { \
        embed_impl<W>(W{t}, tok, cols, out, group.x, tid);                                                  \
    }
EMBED(embed_f32, F32W, float)
EMBED(embed_bf16, Bf16W, ushort)
EMBED(embed_f16, F16W, ushort)
#define EMBED_Q(NAME, BITS)                                                                                 \
    kernel void NAME(device const uint* q [[buffer(0)]], device const float* scale [[buffer(1)]],           \
                     device const float* qbias [[buffer(2)]], constant int& has_qbias [[buffer(3)]],        \
                     constant int& qgroup [[buffer(4)]], device const uint* tok [[buffer(5)]],              \
                     constant int& cols [[buffer(6)]], device float* out [[buffer(7)]],                     \
                     uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) { \
        embed_impl<QW<BITS>>(QW<BITS>{q, scale, qbias, has_qbias, qgroup}, tok, cols, out, group.x, tid);   \
    }
EMBED_Q(embed_q2, 2)
EMBED_Q(embed_q4, 4)
EMBED_Q(embed_q8, 8)

// Widens a weight matrix to f32 (the negative control's input). grid: ceil(n / 256).
kernel void widen_bf16(device const ushort* w [[buffer(0)]], device float* out [[buffer(1)]],
                       constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) out[i] = bf16_to_f32(w[i]);
}
kernel void widen_f16(device const ushort* w [[buffer(0)]], device float* out [[buffer(1)]],
                      constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) out[i] = f16_to_f32(w[i]);
}

// ---------------------------------------------------------------------------------------
// RMSNorm of each n-wide row of x into columns [col, col + n) of out (rows out_width
// wide). grid: rows, threadgroup: 32. Lane L sums x[i]^2 for i = L, L + 32, .. (fma), then
// the butterfly.
kernel void rms_norm(device const float* x [[buffer(0)]], device const float* w [[buffer(1)]],
                     constant int& n [[buffer(2)]], constant float& eps [[buffer(3)]],
                     device float* out [[buffer(4)]], constant int& out_width [[buffer(5)]],
                     constant int& col [[buffer(6)]], uint2 group [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]]) {
    device const float* xr = x + ulong(group.x) * ulong(n);
    float s = 0.0f;
    for (int i = int(tid); i < n; i += 32) s = fma(xr[i], xr[i], s);
    s = simd_sum_fixed(s);
    const float inv = 1.0f / sqrt(s / float(n) + eps);
    device float* o = out + ulong(group.x) * ulong(out_width) + ulong(col);
    for (int i = int(tid); i < n; i += 32) o[i] = w[i] * (xr[i] * inv);
}

// Elementwise ops, grid: ceil(n / 256), threadgroup: 256.
// gate <- silu(gate) * up
kernel void swiglu(device float* g [[buffer(0)]], device const float* u [[buffer(1)]],
                   constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) {
        const float v = g[i];
        g[i] = v / (1.0f + exp(-v)) * u[i];
    }
}
// gate <- gelu_tanh(gate) * up (gelu_pytorch_tanh).
kernel void gelu_tanh_mul(device float* g [[buffer(0)]], device const float* u [[buffer(1)]],
                          constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) {
        const float x = g[i];
        g[i] = 0.5f * x * (1.0f + tanh(0.7978846f * (x + 0.044715f * x * x * x))) * u[i];
    }
}
// x <- x * s
kernel void scale_by(device float* x [[buffer(0)]], constant float& s [[buffer(1)]],
                     constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) x[i] = x[i] * s;
}
// x <- x + y
kernel void add_to(device float* x [[buffer(0)]], device const float* y [[buffer(1)]],
                   constant long& n [[buffer(2)]], uint2 group [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]]) {
    const long i = long(group.x) * 256 + long(tid);
    if (i < n) x[i] = x[i] + y[i];
}

// out[r, c] (+)= y[r, c] (the negative control's epilogue, bias added when given). grid:
// rows, threadgroup: 256.
kernel void add_into(device float* out [[buffer(0)]], device const float* y [[buffer(1)]],
                     device const float* bias [[buffer(2)]], constant int& has_bias [[buffer(3)]],
                     constant int& n [[buffer(4)]], constant int& accumulate [[buffer(5)]],
                     uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    const ulong r = group.x;
    for (int c = int(tid); c < n; c += 256) {
        float v = y[r * ulong(n) + ulong(c)];
        if (has_bias != 0) v += bias[c];
        out[r * ulong(n) + ulong(c)] = accumulate != 0 ? out[r * ulong(n) + ulong(c)] + v : v;
    }
}

// out[i] = x[rows[i]] (rows `width` wide). grid: selected rows, threadgroup: 256.
kernel void gather_rows(device const float* x [[buffer(0)]], device const int* rows [[buffer(1)]],
                        constant int& width [[buffer(2)]], device float* out [[buffer(3)]],
                        uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    const ulong src = ulong(rows[group.x]) * ulong(width);
    for (int c = int(tid); c < width; c += 256) out[ulong(group.x) * ulong(width) + ulong(c)] = x[src + ulong(c)];
}

// out[rows[i]] += weights[i] * src[i] (rows `width` wide, distinct within a dispatch).
// grid: rows of src, threadgroup: 256.
kernel void add_rows_scaled(device float* out [[buffer(0)]], device const float* src [[buffer(1)]],
                            device const int* rows [[buffer(2)]], device const float* weights [[buffer(3)]],
                            constant int& width [[buffer(4)]], uint2 group [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]]) {
    device float* o = out + ulong(rows[group.x]) * ulong(width);
    const float w = weights[group.x];
    for (int c = int(tid); c < width; c += 256) o[c] = o[c] + src[ulong(group.x) * ulong(width) + ulong(c)] * w;
}

// RoPE of every hd-wide head of each `width`-wide row r of x at pos[r] (HF rotate_half:
// element i pairs with i + hd/2). grid: (rows, heads), threadgroup: 32.
kernel void rope_rows(device float* x [[buffer(0)]], constant int& width [[buffer(1)]],
                      constant int& hd [[buffer(2)]], device const int* pos [[buffer(3)]],
                      device const float* cos_t [[buffer(4)]], device const float* sin_t [[buffer(5)]],
                      uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    const int half_hd = hd / 2;
    device float* h = x + ulong(group.x) * ulong(width) + ulong(group.y) * ulong(hd);
    device const float* c = cos_t + ulong(pos[group.x]) * ulong(half_hd);
    device const float* s = sin_t + ulong(pos[group.x]) * ulong(half_hd);
    for (int i = int(tid); i < half_hd; i += 32) {
        const float x1 = h[i], x2 = h[i + half_hd];
        h[i] = x1 * c[i] - x2 * s[i];
        h[i + half_hd] = x2 * c[i] + x1 * s[i];
    }
}

// ---------------------------------------------------------------------------------------
// K/V of one row: blocks of KV_BLOCK slots in its shape's pool buffer, listed in logical
// order by its block table; a block holds 2 * layers planes [layer][K, V][slot][kv_heads
// heads] of `plane` units each, a head `kv_units(hd)` units at (slot * kv_heads + head) *
// kv_units(hd) of its plane (`kv_slot` finds a position's slot; kv.rs). The unit is the
// element of f32 (`float`) or bf16 (`ushort`) K/V, and a
// 32-bit word of quantized K/V (`--kv-bits 8|4`, `QKv<BITS>`). A ring (sliding-window
// layers) keeps committed position p at slot p % ring; a plain store (ring 0) at slot p;
// the open window sits from window_base on in both. Attention and the K/V store run one
// dispatch per row over that row's blocks; a forward's tokens are listed row by row,
// (position, RoPE position, first key, unused) each, and a row's dispatch covers tokens
// [tok0, tok0 + its count).
struct RowKv {
    long plane;
    long committed;
    long window_base;
    long ring;
    long block_slots;
};

// The row's slot of logical position p in the pool: its held slot s (before the block
// table) lies in block table[s / KV_BLOCK], which starts block_slots slots (of a head
// group each) after the previous block index's.
#define KV_BLOCK 64
inline long kv_slot(RowKv row, device const int* table, long p) {
    const long s = p >= row.committed ? row.window_base + (p - row.committed) : (row.ring != 0 ? p % row.ring : p);
    return long(table[s / KV_BLOCK]) * row.block_slots + s % KV_BLOCK;
}

// Quantized K/V in the CPU's format (mtp_cache::QuantLayout): a head is one group of
// words, f32 scale, f32 bias (the head's minimum), then hd BITS-bit codes packed low bits
// first (8 codes a word at 4 bits, 4 at 8: little-endian, so the bytes are the CPU's);
// x = scale * q + bias, a multiply then an add (never fused), as on the CPU. hd % 8 == 0
// (check_gpu_kv): a head is whole words.
template <int BITS>
struct QKv {
    uint w;
};

// Units of one head.
inline int kv_units(device const float*, int hd) { return hd; }
inline int kv_units(device const ushort*, int hd) { return hd; }
template <int BITS>
inline int kv_units(device const QKv<BITS>*, int hd) {
    return 2 + hd * BITS / 32;
}

// Value d of the head at h, widened to f32.
inline float kv_get(device const float* h, int d) { return h[d]; }
inline float kv_get(device const ushort* h, int d) { return bf16_to_f32(h[d]); }
template <int BITS>
inline float kv_get(device const QKv<BITS>* h, int d) {
    const uint code = (h[2 + d * BITS / 32].w >> uint(d * BITS % 32)) & ((1u << BITS) - 1u);
    const float scaled = as_type<float>(h[0].w) * float(code);
    return scaled + as_type<float>(h[1].w);
}

// What the K/V store takes for one head: the V projection's values, or a q or K head's
// after the optional per-head RMSNorm (`inv` its 1 / rms, weights nw) and RoPE (HF
// rotate_half: element i pairs with i + hd/2), `pair` computing elements i and i + hd/2.
struct Values {
    device const float* p;
    float get(int e) const { return p[e]; }
};
struct Rotated {
    device const float* src;
    device const float* nw;
    int has_norm;
    float inv;
    device const float* c;
    device const float* sn;
    int half_hd;
    void pair(int i, thread float& a, thread float& b) const {
        float x1 = src[i], x2 = src[i + half_hd];
        if (has_norm != 0) {
            x1 = nw[i] * (x1 * inv);
            x2 = nw[i + half_hd] * (x2 * inv);
        }
        a = x1 * c[i] - x2 * sn[i];
        b = x2 * c[i] + x1 * sn[i];
    }
    float get(int e) const {
        float a, b;
        pair(e < half_hd ? e : e - half_hd, a, b);
        return e < half_hd ? a : b;
    }
};

// Stores the hd values of `src` as the head at h; all 32 lanes of the SIMD-group call.
// Dense: lane L writes elements L, L + 32, ..
template <class S>
inline void kv_put_head(device float* h, S src, int hd, int lane) {
    for (int i = lane; i < hd; i += 32) h[i] = src.get(i);
}
template <class S>
inline void kv_put_head(device ushort* h, S src, int hd, int lane) {
    for (int i = lane; i < hd; i += 32) h[i] = f32_to_bf16(src.get(i));
}
// Quantized, as the CPU's QuantLayout::quantize_head: lo and hi the minimum and maximum of
// the values (NaN ignored: fmin/fmax over each lane's, then the butterfly; min and max
// are exact in any order), scale = (hi - lo) / levels, inv = 1 / scale (0 unless
// scale > 0), q = round((x - lo) * inv) (half away from zero) clamped to [0, levels], NaN
// to 0. Lane L packs code words L, L + 32, .. (each value computed again where it is
// packed: `src` gives the same bits every call); lane 0 writes the scale and the bias.
template <int BITS, class S>
inline void kv_put_head(device QKv<BITS>* h, S src, int hd, int lane) {
    float lo = as_type<float>(0x7f800000u), hi = as_type<float>(0xff800000u);
    for (int e = lane; e < hd; e += 32) {
        const float x = src.get(e);
        lo = fmin(lo, x);
        hi = fmax(hi, x);
    }
    lo = simd_min_fixed(lo);
    hi = simd_max_fixed(hi);
    const float levels = float((1u << BITS) - 1u);
    const float scale = (hi - lo) / levels;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    if (lane == 0) {
        h[0].w = as_type<uint>(scale);
        h[1].w = as_type<uint>(lo);
    }
    const int per = 32 / BITS;
    for (int w = lane; w < hd / per; w += 32) {
        uint word = 0u;
        for (int j = 0; j < per; j++) {
            const float r = round((src.get(w * per + j) - lo) * inv);
            const uint code = r >= 0.0f ? uint(fmin(r, levels)) : 0u;  // NaN fails r >= 0
            word |= code << uint(j * BITS);
        }
        h[2 + w].w = word;
    }
}

// Per (token, head): optional per-head RMSNorm (q and k), RoPE at the token's RoPE
// position, then q back in place and K, V stored at the token's window slot of `layer`
// (`kv_put_head`: quantized K/V one group per head). grid: (row tokens, heads +
// 2 * kv_heads), or (row tokens, heads) to rotate q alone (has_kv 0); threadgroup: 32.
// Lane L handles the pairs (i, i + hd/2), i = L, L + 32, .. of q; the norm's butterfly runs
// before any lane writes, so q is rewritten in place safely.
template <class KV>
void qk_rope_store_impl(device float* q, device const float* k, device const float* v,
                        device const float* q_norm, device const float* k_norm, int has_norm, float eps,
                        device const float* cos_t, device const float* sin_t, device const int* toks, int tok0,
                        device KV* kv, RowKv row, int layer, int heads, int kv_heads, int hd,
                        device const int* table, uint2 group, uint tid) {
    const int t = tok0 + int(group.x), y = int(group.y);
    const int pos = toks[4 * t], rope_pos = toks[4 * t + 1];
    const long kvd = long(kv_heads) * long(hd);
    const int units = kv_units(kv, hd);
    const long slot = kv_slot(row, table, pos);
    device KV* kbuf = kv + long(2 * layer) * row.plane;
    device KV* vbuf = kv + long(2 * layer + 1) * row.plane;
    const int lane = int(tid);
    if (y >= heads + kv_heads) {  // V: stored as is (quantized: as one group)
        const int hv = y - heads - kv_heads;
        kv_put_head(vbuf + (slot * kv_heads + hv) * units, Values{v + long(t) * kvd + hv * hd}, hd, lane);
        return;
    }
    const bool is_q = y < heads;
    device const float* src = is_q ? q + (long(t) * heads + y) * hd : k + long(t) * kvd + long(y - heads) * hd;
    float inv = 1.0f;
    if (has_norm != 0) {
        float s = 0.0f;
        for (int i = lane; i < hd; i += 32) s = fma(src[i], src[i], s);
        s = simd_sum_fixed(s);
        inv = 1.0f / sqrt(s / float(hd) + eps);
    }
    const int half_hd = hd / 2;
    const Rotated rot{src,
                      is_q ? q_norm : k_norm,
                      has_norm,
                      inv,
                      cos_t + long(rope_pos) * half_hd,
                      sin_t + long(rope_pos) * half_hd,
                      half_hd};
    if (!is_q) {
        kv_put_head(kbuf + (slot * kv_heads + (y - heads)) * units, rot, hd, lane);
        return;
    }
    device float* dst = q + (long(t) * heads + y) * hd;
    for (int i = lane; i < half_hd; i += 32) {
        float a, b;
        rot.pair(i, a, b);
        dst[i] = a;
        dst[i + half_hd] = b;
    }
}

#define QK_STORE(NAME, KV)                                                                                  \
    kernel void NAME(device float* q [[buffer(0)]], device const float* k [[buffer(1)]],                    \
                     device const float* v [[buffer(2)]], device const float* q_norm [[buffer(3)]],         \
                     device const float* k_norm [[buffer(4)]], constant int& has_norm [[buffer(5)]],        \
                     constant float& eps [[buffer(6)]], device const float* cos_t [[buffer(7)]],            \
                     device const float* sin_t [[buffer(8)]], device const int* toks [[buffer(9)]],         \
                     constant int& tok0 [[buffer(10)]], device KV* kv [[buffer(11)]],                       \
                     constant RowKv& row [[buffer(12)]], constant int& layer [[buffer(13)]],                \
                     constant int& heads [[buffer(14)]], constant int& kv_heads [[buffer(15)]],             \
                     constant int& hd [[buffer(16)]], device const int* table [[buffer(17)]],               \
                     uint2 group [[threadgroup_position_in_grid]],                                          \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        qk_rope_store_impl<KV>(q, k, v, q_norm, k_norm, has_norm, eps, cos_t, sin_t, toks, tok0, kv, row,   \
                               layer, heads, kv_heads, hd, table, group, tid);                              \
    }
QK_STORE(qk_rope_store_f32, float)
QK_STORE(qk_rope_store_bf16, ushort)
QK_STORE(qk_rope_store_q8, QKv<8>)
QK_STORE(qk_rope_store_q4, QKv<4>)

// Attention. One SIMD-group per (token, head): the query at logical position p reads keys
// [first, p] of its own row (first = max(the token's first key, p + 1 - window) with a
// window) in chunks of 32 anchored at position 0; lane j scores key c0 + j (dot product in
// increasing d), the chunk's maximum and sum come from the butterfly, and each lane
// accumulates its output dims d = lane + 32 t over the chunk's keys in order. Every K and V
// value is widened (quantized: dequantized) on load by `kv_get`. `splits` > 1 is the
// negative control only: the keys cut into that many segments, each with its own online
// softmax, merged at the end. grid: (row tokens, heads), threadgroup: 32. hd up to MAX_HD
// (256, or 512 for Gemma 4's global layers: a variant picked by head size alone).
template <class KV, int MAX_HD>
void attention_impl(device const float* q, device float* out, device const int* toks, int tok0,
                    device const KV* kv, RowKv row, int layer, int heads, int kv_heads, int hd, float scale,
                    int splits, int window, device const int* table, uint2 group, uint tid) {
    const int t = tok0 + int(group.x), head = int(group.y), lane = int(tid);
    const int pos = toks[4 * t], first_key = toks[4 * t + 2];
    const int units = kv_units(kv, hd);
    const long kvd = long(kv_heads) * long(units);
    const int kvh = head / (heads / kv_heads);
    device const KV* kbuf = kv + long(2 * layer) * row.plane + long(kvh) * units;
    device const KV* vbuf = kv + long(2 * layer + 1) * row.plane + long(kvh) * units;
    device const float* qh = q + (long(t) * heads + head) * hd;
    const int n_keys = pos + 1;
    const int first = max(first_key, window > 0 ? n_keys - window : 0);
    const int dims = (hd + 31) / 32;
    const float neg_inf = as_type<float>(0xff800000u);
    float tot_m = neg_inf, tot_l = 0.0f, tot[MAX_HD / 32];
    for (int d = 0; d < MAX_HD / 32; d++) tot[d] = 0.0f;
    for (int sp = 0; sp < splits; sp++) {
        const int span = n_keys - first;
        const int k0 = first + int(long(span) * sp / splits);
        const int k1 = first + int(long(span) * (sp + 1) / splits);
        float m = neg_inf, l = 0.0f, acc[MAX_HD / 32];
        for (int d = 0; d < MAX_HD / 32; d++) acc[d] = 0.0f;
        // Chunks anchored at position 0 (the split control cuts its own segments).
        const int start = splits == 1 ? k0 - k0 % 32 : k0;
        for (int c0 = start; c0 < k1; c0 += 32) {
            const int p = c0 + lane;
            const bool valid = p >= k0 && p < k1;
            float sc = neg_inf;
            if (valid) {
                device const KV* kh = kbuf + kv_slot(row, table, p) * kvd;
                float dot = 0.0f;
                for (int d = 0; d < hd; d++) dot = fma(qh[d], kv_get(kh, d), dot);
                sc = dot * scale;
            }
            const float cm = simd_max_fixed(sc);
            const float m_new = fmax(m, cm);
            if (m_new > m) {
                const float alpha = exp(m - m_new);
                l *= alpha;
                for (int d = 0; d < MAX_HD / 32; d++) acc[d] *= alpha;
                m = m_new;
            }
            const float pj = valid ? exp(sc - m) : 0.0f;
            l += simd_sum_fixed(pj);
            const int nk = min(32, k1 - c0);
            for (int j = 0; j < nk; j++) {
                const float pb = simd_shuffle(pj, ushort(j));
                device const KV* vh = vbuf + kv_slot(row, table, max(c0 + j, k0)) * kvd;  // pb = 0 below k0
                for (int d = 0; d < MAX_HD / 32; d++) {
                    const int dd = lane + 32 * d;
                    if (d < dims && dd < hd) acc[d] = fma(pb, kv_get(vh, dd), acc[d]);
                }
            }
        }
        if (splits == 1) {
            tot_m = m;
            tot_l = l;
            for (int d = 0; d < MAX_HD / 32; d++) tot[d] = acc[d];
        } else if (k1 > k0) {
            const float nm = fmax(tot_m, m);
            const float a = exp(tot_m - nm), b = exp(m - nm);
            tot_l = tot_l * a + l * b;
            for (int d = 0; d < MAX_HD / 32; d++) tot[d] = tot[d] * a + acc[d] * b;
            tot_m = nm;
        }
    }
    const float inv = 1.0f / tot_l;
    device float* o = out + (long(t) * heads + head) * hd;
    for (int d = 0; d < MAX_HD / 32; d++) {
        const int dd = lane + 32 * d;
        if (d < dims && dd < hd) o[dd] = tot[d] * inv;
    }
}

#define ATTENTION(NAME, KV, MAX_HD)                                                                         \
    kernel void NAME(device const float* q [[buffer(0)]], device float* out [[buffer(1)]],                  \
                     device const int* toks [[buffer(2)]], constant int& tok0 [[buffer(3)]],                \
                     device const KV* kv [[buffer(4)]], constant RowKv& row [[buffer(5)]],                  \
                     constant int& layer [[buffer(6)]], constant int& heads [[buffer(7)]],                  \
                     constant int& kv_heads [[buffer(8)]], constant int& hd [[buffer(9)]],                  \
                     constant float& scale [[buffer(10)]], constant int& splits [[buffer(11)]],             \
                     constant int& window [[buffer(12)]], device const int* table [[buffer(13)]],           \
                     uint2 group [[threadgroup_position_in_grid]],                                          \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        attention_impl<KV, MAX_HD>(q, out, toks, tok0, kv, row, layer, heads, kv_heads, hd, scale, splits,  \
                                   window, table, group, tid);                                              \
    }
ATTENTION(attention_f32, float, 256)
ATTENTION(attention_bf16, ushort, 256)
ATTENTION(attention_f32_512, float, 512)
ATTENTION(attention_bf16_512, ushort, 512)
ATTENTION(attention_q8, QKv<8>, 256)
ATTENTION(attention_q4, QKv<4>, 256)
ATTENTION(attention_q8_512, QKv<8>, 512)
ATTENTION(attention_q4_512, QKv<4>, 512)

// ---------------------------------------------------------------------------------------
// KV store maintenance on raw units (4-byte words for f32 and quantized K/V, 2-byte for bf16).
//
// Moves slots [from, from + n) down to [to, to + n) of every plane (to < from, the ranges
// may overlap): one threadgroup per plane walks forward in chunks, all reads of a chunk
// before any write; writes land below every element not yet read. grid: planes, 256.
template <class E>
void kv_move_impl(device E* base, long plane, long from, long to, long n, uint group, uint tid) {
    device E* p = base + long(group) * plane;
    for (long c = 0; c < n; c += 256) {
        const long i = c + long(tid);
        const E v = i < n ? p[from + i] : E(0);
        threadgroup_barrier(mem_flags::mem_device);
        if (i < n) p[to + i] = v;
        threadgroup_barrier(mem_flags::mem_device);
    }
}
#define KV_MOVE(NAME, E)                                                                                    \
    kernel void NAME(device E* b [[buffer(0)]], constant long& plane [[buffer(1)]],                         \
                     constant long& from [[buffer(2)]], constant long& to [[buffer(3)]],                    \
                     constant long& n [[buffer(4)]], uint2 group [[threadgroup_position_in_grid]],          \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        kv_move_impl<E>(b, plane, from, to, n, group.x, tid);                                               \
    }
KV_MOVE(kv_move_4, uint)
KV_MOVE(kv_move_2, ushort)

// Copies the first n elements of every plane from src (planes of src_plane elements) to
// dst (planes of dst_plane) and zeroes dst elements [zero_from, zero_to) (src may be dst
// when n is 0). grid: (blocks, planes), threadgroup: 256.
template <class E>
void kv_copy_impl(device const E* src, long src_plane, device E* dst, long dst_plane, long n, long zero_from,
                  long zero_to, long blocks, uint2 group, uint tid) {
    device const E* s = src + long(group.y) * src_plane;
    device E* d = dst + long(group.y) * dst_plane;
    const long work = n + (zero_to > zero_from ? zero_to - zero_from : 0);
    for (long j = long(group.x) * 256 + long(tid); j < work; j += blocks * 256) {
        if (j < n)
            d[j] = s[j];
        else
            d[zero_from + (j - n)] = E(0);
    }
}
#define KV_COPY(NAME, E)                                                                                    \
    kernel void NAME(device const E* s [[buffer(0)]], constant long& sp [[buffer(1)]],                      \
                     device E* d [[buffer(2)]], constant long& dp [[buffer(3)]], constant long& n [[buffer(4)]], \
                     constant long& z0 [[buffer(5)]], constant long& z1 [[buffer(6)]],                      \
                     constant long& blocks [[buffer(7)]], uint2 group [[threadgroup_position_in_grid]],     \
                     uint tid [[thread_index_in_threadgroup]]) {                                            \
        kv_copy_impl<E>(s, sp, d, dp, n, z0, z1, blocks, group, tid);                                       \
    }
KV_COPY(kv_copy_4, uint)
KV_COPY(kv_copy_2, ushort)
