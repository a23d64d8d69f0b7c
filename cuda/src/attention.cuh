// The CUDA-core attention (`attention_*`, `attention_merge`). Host side: attention.rs.
// Part of kernels.cu's one compilation unit (included in order, after qk_rope_store.cuh).

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
