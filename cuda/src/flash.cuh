// Attention on the tensor cores: included by flash_kernels.cuh (kernels.cu's mma.sync kernels)
// and hopper.cu (wgmma).
//
// Taken where activations are bf16 and K/V are stored in bf16 (CUDA's default for 16-bit
// checkpoints), for head sizes that are multiples of 8 up to 128 and at most 8 query heads
// per KV head (`Cuda::flash_runs`); other shapes keep the CUDA-core kernels. Every query,
// in prefill, verify and decode alike, gets one arithmetic, fixed by positions alone:
//   - q is rounded to bf16 (nearest even); keys are cut into chunks of FA_CHUNK (64)
//     anchored at position 0, chunks into segments of FA_SEG_CHUNKS (8: 512 keys);
//   - a chunk's scores are one mma.sync m16n8k16 chain over the head dims in increasing
//     16-wide steps (dims past hd are zero), times scale log2(e); the chunk's maximum and
//     its sum of 2^(s - m) (each lane its 16 values in key order, then the quad's
//     butterfly) update an online softmax; the probabilities, rounded to bf16, meet V in
//     one mma chain over the chunk's four 16-key steps, into the running output scaled by
//     the maximum's change (a chunk without any of the query's keys leaves it as it was);
//   - a segment's state is merged into the query's in segment order (`fa_merge`, which
//     `flash_merge` repeats for the split launch), then normalised.
// An mma computes each output row from that row's inputs alone (cuda/probes/mma_bits.cu),
// so a query's bits do not depend on the other queries in its 16-row tile. A block takes
// one tile of a row's consecutive tokens (host-built `tiles`: first token, count, at most
// 16: `TILE` in flash.rs) times the G query heads of one KV head, 16 (token, head) rows a
// warp, and each K/V chunk it loads feeds them all. Keys outside a query's range score -inf (probability
// exactly 0). Keys outside every query's range of the block load as zeros.
// The work a chunk costs is cut where the bits allow: a chunk inside every key range of a
// warp's rows skips the mask, one where every live row has a key takes each MMA's result
// without the keep-state select (a masked probability is then exactly 0 already), and a
// chunk of consecutive slots copies K/V by stepped addresses; the full-width kernel
// (hd == MAX_HD) is compiled with its sizes constant.
// On Hopper (hopper.cu: `Wg` = FaWgmma) a warpgroup's 64 rows take each chunk's scores and
// P V as wgmma chains over the same 16-wide steps, K and V read by the tensor cores from
// shared memory in the 128-byte swizzle (a wgmma over 16 k gives the bits of mma.sync over
// the same 16 k: cuda/probes/mma_bits.cu), and each row's softmax as above; a chunk where
// some live row of the warpgroup keeps its state, or lies outside a live warp's keys, takes
// the mma.sync P V of its warps. So a query's bits are the same from either kernel.
// Two launches compute the same bits, as for the CUDA-core kernel: a block per (tile, KV
// head) walking the segments (`partial` null), or a block per (tile, KV head, segment)
// writing each query's segment state to `partial` for `flash_merge`. A walking block whose
// keys lie in one segment normalises that state into `out` as it ends (merged into the
// empty state, a state is itself).
// Rows that hold the same blocks for their first keys (a shared prompt prefix) read them once
// for all (`flash::share` groups them): a shared tile takes up to 16 tokens of several such
// rows, all reading K/V through its first token's block table, and writes each query's states
// of the shared segments [0, seg_hi) to `shared` as a split launch does; each row's own tile
// then walks from segment seg_lo (= that seg_hi) on, merging the shared states first, in
// segment order. A query's states, and the order they merge in, are those of reading alone.
// A tile is four ints: first token, count, seg_lo, seg_hi (0 and INT_MAX: every segment).
// `splits` > 1 is the negative control only: the chunks' anchor moves by a batch-sized
// offset (64 - 2 splits), so a query's chunking follows the batch.
// grid: (tiles, kv_heads * segments), block: 32 W (W warps, 16 W >= the tile's tokens x
// G; at least 4, so that a decode step's few rows still load with 128 threads), dynamic
// shared memory as `smem_bytes` in flash.rs lays it out (two K/V stages, the q tile, each
// lane's merged outputs, each warp's key range): the stages first, at the start (1,024-byte
// aligned), as the swizzle wgmma reads needs them.
#define FA_CHUNK 64
// A chunk that starts a K/V block lies in it (`consecutive` in the loads below).
static_assert(KV_BLOCK % FA_CHUNK == 0, "a K/V block holds whole attention chunks");
#define FA_SEG_CHUNKS 8
#define FA_MAX_WARPS 8

template <bool B>
struct FaBool {
    static constexpr bool value = B;
};

// The mma.sync kernels' `Wg`: no wgmma.
struct FaMmaSync {
    static constexpr bool on = false;
};

__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 fa_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void fa_ldsm_x4(u32* r, const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fa_ldsm_x4_trans(u32* r, const u16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// d = a b + c (m16n8k16, bf16 in, f32 accumulate).
__device__ __forceinline__ void fa_mma(float* d, const u32* a, u32 b0, u32 b1, const float* c) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// 16 bytes from global memory to shared address `s`, or zeros where `size` is 0.
__device__ __forceinline__ void fa_cp16(u32 s, const u16* gmem, int size) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(size));
}

__device__ __forceinline__ u32 fa_saddr(const u16* p) { return (u32)__cvta_generic_to_shared(p); }

// Element (r, d) of a [rows][hdp] bf16 tile in shared memory: 16-byte pieces swizzled by the
// row (so ldmatrix's eight rows hit different banks), within aligned groups of pieces whose
// size (a power of two, at most 8) divides the row's hdp / 8: no piece leaves its row.
__device__ __forceinline__ int fa_at(int r, int d, int hdp) {
    const int pieces = hdp / 8, mask = min(pieces & -pieces, 8) - 1;
    return r * hdp + (((d >> 3) ^ (r & mask)) << 3) + (d & 7);
}

// Element (r, d) of a chunk's K or V tile ([FA_CHUNK][hdp] bf16): where hdp is a multiple of
// 64, 64-dim blocks of 128-byte rows ([d / 64][r][64]) in the 128-byte swizzle (piece
// (d % 64) / 8 of row r at piece ^ (r % 8)), the layout wgmma reads; else `fa_at`.
__device__ __forceinline__ int fa_kv_at(int r, int d, int hdp) {
    if (hdp % 64) return fa_at(r, d, hdp);
    return ((d >> 6) * FA_CHUNK + r) * 64 + ((((d >> 3) & 7) ^ (r & 7)) << 3) + (d & 7);
}

// Whether `v` holds for every thread of the block's warpgroup whose named barrier is
// `barrier` (128 threads).
__device__ __forceinline__ bool fa_group_all(bool v, int barrier) {
    u32 r;
    asm volatile(
        "{ .reg .pred p, q; setp.ne.u32 q, %1, 0; bar.red.and.pred p, %2, 128, q; selp.u32 %0, 1, 0, p; }"
        : "=r"(r)
        : "r"((u32)v), "r"(barrier)
        : "memory");
    return r != 0;
}

// The A fragment of P's 16-key step kk (keys 16 kk..16 kk + 15 of this lane's rows g, g + 8),
// the probabilities `s` rounded to bf16: mma.sync's layout, and wgmma's from registers.
__device__ __forceinline__ void fa_p_frag(u32 (&a)[4], const float (&s)[8][4], int kk) {
    a[0] = fa_pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = fa_pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Merges the state (m2, l2, acc2) of later keys into (m, l, acc) (maxima in log2 units): taken
// as is into an empty state, else both scaled to the larger maximum. A state without keys
// (l2 == 0) adds nothing. `flash_attention` and `flash_merge` both merge with it: either
// launch gives the same bits.
template <int N>
__device__ __forceinline__ void fa_merge(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    if (l2 == 0.0f) return;
    if (l == 0.0f) {
        m = m2;
        l = l2;
#pragma unroll
        for (int i = 0; i < N; i++) acc[i] = acc2[i];
        return;
    }
    const float nm = fmaxf(m, m2);
    const float a = fa_exp2(m - nm), b = fa_exp2(m2 - nm);
    l = fmaf(l2, b, __fmul_rn(l, a));
#pragma unroll
    for (int i = 0; i < N; i++) acc[i] = fmaf(acc2[i], b, __fmul_rn(acc[i], a));
    m = nm;
}

// FULL: hd == MAX_HD (the host launches the `_full` kernel only then), so every size below
// is known at compile time; the arithmetic is the same.
template <int MAX_HD, bool FULL, class Wg>
__device__ void flash_impl(const float* q, float* out, float* partial, const float* shared, int shared_segs,
                           const Tok* toks, const RowKv* rows, const int* tiles, int layer, int heads, int kv_heads,
                           int hd, float scale, int splits, int window) {
    constexpr int NT = MAX_HD / 8;  // 8-dim output tiles a row holds at most
    if (FULL) hd = MAX_HD;
    // 1,024-byte aligned: the period of the 128-byte swizzle wgmma reads K and V in.
    extern __shared__ __align__(1024) unsigned char fa_smem[];
    const int hdp = (hd + 15) & ~15, ks_n = hdp / 16, nt_n = hdp / 8, cpr = hdp / 8;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    u16* kvs = reinterpret_cast<u16*>(fa_smem);  // [stage][K, V][FA_CHUNK][hdp]
    u16* qs = kvs + 2 * 2 * FA_CHUNK * hdp;
    float* tots = reinterpret_cast<float*>(qs + 16 * warps * hdp);
    float* tot = tots + warp * 32 * (MAX_HD / 2);
    int* warp_keys = reinterpret_cast<int*>(tots + warps * 32 * (MAX_HD / 2));  // [warp][lo, hi)
    if constexpr (Wg::on)
        if ((__cvta_generic_to_shared(kvs) & 1023) != 0) __trap();  // never, by fa_smem's alignment

    // The last tiles first: a prompt's later tokens read the most keys (the long blocks start
    // early, the short ones fill the tail).
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int t0 = tiles[4 * tile], nt = tiles[4 * tile + 1];
    // The tile's segments [seg_lo, seg_hi): a shared tile's end where its rows' blocks part,
    // an own tile's start past the segments its shared tile computed (their states in `shared`).
    const int seg_lo = tiles[4 * tile + 2], seg_hi = tiles[4 * tile + 3];
    const int kvh = blockIdx.y % kv_heads, seg = blockIdx.y / kv_heads, max_segs = gridDim.y / kv_heads;
    if (partial && (seg < seg_lo || seg >= seg_hi)) return;  // (the whole block: nothing to write)
    const int G = heads / kv_heads, n_rows = nt * G;
    const int shift = splits > 1 ? FA_CHUNK - 2 * splits : 0;
    const RowKv row = rows[toks[t0].row];
    const int kvd = kv_heads * hd;
    const u16* kbuf = reinterpret_cast<const u16*>(row.base) + (long long)(2 * layer) * row.plane + kvh * hd;
    const u16* vbuf = reinterpret_cast<const u16*>(row.base) + (long long)(2 * layer + 1) * row.plane + kvh * hd;

    // The block's keys: the union of its tokens' ranges.
    int lo = 0x7fffffff, hi = 0;
    for (int i = 0; i < nt; i++) {
        const Tok tk = toks[t0 + i];
        const int n_keys = tk.pos + 1;
        lo = min(lo, max(tk.first, window > 0 ? n_keys - window : 0));
        hi = max(hi, n_keys);
    }
    // This lane's two rows (g and g + 8 of its warp's 16): token, head, key range.
    int tok[2], head[2], first[2], n_keys[2];
    int w_lo = 0x7fffffff, w_hi = 0;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const int r = 16 * warp + g + 8 * rr;
        tok[rr] = t0 + r / G;
        head[rr] = kvh * G + r % G;
        first[rr] = n_keys[rr] = 0;
        if (r < n_rows) {
            const Tok tk = toks[tok[rr]];
            n_keys[rr] = tk.pos + 1;
            first[rr] = max(tk.first, window > 0 ? n_keys[rr] - window : 0);
        }
    }
    // The warp's keys (every lane: the same rows, by the quads' butterfly), and the keys
    // every one of its rows reads, [w_all_lo, w_all_hi): a chunk inside them needs no mask.
    // (A token at a time: its G rows share its range.)
    int w_all_lo = 0, w_all_hi = 0x7fffffff;
    for (int i = 16 * warp / G; i < nt && i * G < 16 * warp + 16; i++) {
        const Tok tk = toks[t0 + i];
        const int nk = tk.pos + 1, fk = max(tk.first, window > 0 ? nk - window : 0);
        w_lo = min(w_lo, fk);
        w_hi = max(w_hi, nk);
        w_all_lo = max(w_all_lo, fk);
        w_all_hi = min(w_all_hi, nk);
    }
    if (lane == 0) {
        warp_keys[2 * warp] = w_lo;
        warp_keys[2 * warp + 1] = w_hi;
    }

    // q rounded to bf16, rows past the tile's and dims past hd zero. Each warp fills its own
    // 16 rows, a row's pairs over the lanes (row r + 1 is the next head of r's token, or the
    // next token's first: no division a pair), QR rows' loads issued before any is stored.
    // With wgmma each warpgroup's 64 rows in fa_kv_at's layout (the tensor cores read q from
    // there, padding rows included), else fa_at's (ldmatrix reads it; a warp without rows
    // never does, and fills nothing).
    auto q_at = [&](int r, int d) { return Wg::on ? (r >> 6) * 64 * hdp + fa_kv_at(r & 63, d, hdp) : fa_at(r, d, hdp); };
    auto fill_q = [&]() {
        constexpr int QR = 4, PH = (MAX_HD / 2 + 31) / 32;  // rows a batch of loads, pairs a lane
        const int r0 = 16 * warp;
        if (!Wg::on && r0 >= n_rows) return;
        int hq = r0 % G;
        long long at = ((long long)(t0 + r0 / G) * heads + kvh * G + hq) * hd;  // row r0's q
        // Rows r0 .. r0 + rows - 1 (`rows` a multiple of QR) from q, zeros past the tile's.
        auto from_q = [&](int rows) {
            for (int j0 = 0; j0 < rows; j0 += QR) {
                float2 v[QR][PH];
#pragma unroll
                for (int u = 0; u < QR; u++) {
#pragma unroll
                    for (int h = 0; h < PH; h++) {
                        const int d = 2 * (lane + 32 * h);
                        v[u][h] = make_float2(0.0f, 0.0f);
                        if (r0 + j0 + u < n_rows && d < hd) v[u][h] = __ldg(reinterpret_cast<const float2*>(q + at + d));
                    }
                    at += hd;
                    if (++hq == G) hq = 0, at += (long long)(heads - G) * hd;
                }
#pragma unroll
                for (int u = 0; u < QR; u++)
#pragma unroll
                    for (int h = 0; h < PH; h++) {
                        const int d = 2 * (lane + 32 * h);
                        if (d < hdp) *reinterpret_cast<u32*>(qs + q_at(r0 + j0 + u, d)) = fa_pack(v[u][h].x, v[u][h].y);
                    }
            }
        };
        if (Wg::on || n_rows - r0 >= 16) {
            from_q(16);  // (a constant trip count: a prompt's warps)
            return;
        }
        // A warp of a decode or verify tile: its rows with a query (to a multiple of QR), then
        // the rest zeroed in one sweep (fa_at keeps each row's pieces in the row).
        const int rows = (n_rows - r0 + QR - 1) / QR * QR;
        from_q(rows);
        uint4* z = reinterpret_cast<uint4*>(qs + (r0 + rows) * hdp);
        for (int i = lane; i < (16 - rows) * hdp / 8; i += 32) z[i] = make_uint4(0u, 0u, 0u, 0u);
    };

    // The chunks this block walks (in the shifted key space of the negative control).
    int c_begin = (lo + shift) / FA_CHUNK, c_end = hi > lo ? (hi - 1 + shift) / FA_CHUNK : c_begin - 1;
    if (partial) {
        c_begin = max(c_begin, seg * FA_SEG_CHUNKS);
        c_end = min(c_end, seg * FA_SEG_CHUNKS + FA_SEG_CHUNKS - 1);
    }
    c_begin = max(c_begin, seg_lo * FA_SEG_CHUNKS);
    if (seg_hi < 0x7fffffff / FA_SEG_CHUNKS) c_end = min(c_end, seg_hi * FA_SEG_CHUNKS - 1);
    // Chunk c's K and V into `stage`: keys outside [lo, hi) and dims past hd as zeros. A
    // thread copies the 16-byte pieces threadIdx.x, + blockDim.x, ... of the chunk's
    // (key, piece) grid, stepped without a division.
    const int step_key = blockDim.x / cpr, step_piece = blockDim.x % cpr;
    const int key0 = threadIdx.x / cpr, piece0 = threadIdx.x % cpr;
    // Where a thread keeps one piece and its keys step by a multiple of 8 (the swizzle's
    // period), its pieces' places in shared memory step by whole rows.
    const bool one_piece = step_piece == 0 && step_key % 8 == 0;
    // (In bytes: V's tile after K's, and one step's rows.)
    const u32 v_bytes = FA_CHUNK * hdp * 2, d_step = step_key * (hdp % 64 ? hdp : 64) * 2;
    auto load = [&](int c, int stage) {
        u16* ks = kvs + stage * 2 * FA_CHUNK * hdp;
        u16* vs = ks + FA_CHUNK * hdp;
        const int c0 = c * FA_CHUNK - shift;
        // Every key in range and its slots consecutive (one side of the committed length,
        // no ring, one block: the chunk starts a block): the slot of key c0 + i is the first
        // one's plus i.
        const bool in_range = c0 >= lo && c0 + FA_CHUNK <= hi;
        const bool consecutive = (c0 >= row.committed || (c0 + FA_CHUNK <= row.committed && row.ring == 0))
            && kv_held_slot(row, c0) % KV_BLOCK == 0;
        if (one_piece && in_range && consecutive) {
            const int ok = 8 * piece0 < hd ? 16 : 0;
            const long long at = ok ? (kv_slot(row, c0) + key0) * kvd + 8 * piece0 : 0;
            const long long g_step = ok ? (long long)step_key * kvd : 0;
            const u16 *kg = kbuf + at, *vg = vbuf + at;
            u32 kd = fa_saddr(ks + fa_kv_at(key0, 8 * piece0, hdp));
            for (int key = key0; key < FA_CHUNK; key += step_key) {
                fa_cp16(kd, kg, ok);
                fa_cp16(kd + v_bytes, vg, ok);
                kg += g_step, vg += g_step, kd += d_step;
            }
            return;
        }
        if (one_piece) {
            // A chunk past some key's range (a decode step's last): the same stepped places,
            // each key's slot its own where the slots are not consecutive.
            const bool piece_ok = 8 * piece0 < hd;
            const long long slot0 = consecutive ? kv_slot(row, c0) : 0;
            u32 kd = fa_saddr(ks + fa_kv_at(key0, 8 * piece0, hdp));
            for (int key = key0; key < FA_CHUNK; key += step_key, kd += d_step) {
                const int p = c0 + key;
                const bool ok = piece_ok && p >= lo && p < hi;
                const long long at = ok ? (consecutive ? slot0 + key : kv_slot(row, p)) * kvd + 8 * piece0 : 0;
                fa_cp16(kd, kbuf + at, ok ? 16 : 0);
                fa_cp16(kd + v_bytes, vbuf + at, ok ? 16 : 0);
            }
            return;
        }
        for (int key = key0, piece = piece0; key < FA_CHUNK;) {
            const int p = c0 + key;
            const bool ok = p >= lo && p < hi && 8 * piece < hd;
            const long long at = ok ? kv_slot(row, p) * kvd + 8 * piece : 0;
            fa_cp16(fa_saddr(ks + fa_kv_at(key, 8 * piece, hdp)), kbuf + at, ok ? 16 : 0);
            fa_cp16(fa_saddr(vs + fa_kv_at(key, 8 * piece, hdp)), vbuf + at, ok ? 16 : 0);
            key += step_key;
            piece += step_piece;
            if (piece >= cpr) piece -= cpr, key++;
        }
    };

    // The first chunk's loads go out before q's (they do not wait for each other).
    if (c_begin <= c_end) {
        load(c_begin, 0);
        asm volatile("cp.async.commit_group;");
    }
    fill_q();
    // The stores, made visible to the tensor cores' reads (async proxy).
    if constexpr (Wg::on) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

    const float scale2 = __fmul_rn(scale, 1.4426950408889634f);
    const float NEG_INF = __int_as_float(0xff800000);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};      // the segment's state
    float tm[2] = {NEG_INF, NEG_INF}, tl[2] = {0.0f, 0.0f};    // the query's merged state
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
    const bool warp_live = 16 * warp < n_rows;
    __syncthreads();
    // The keys of the warpgroup's live warps (a warp without rows keeps the empty range).
    int g_lo = 0x7fffffff, g_hi = 0;
    if constexpr (Wg::on)
        for (int w = warp & ~3; w < (warp & ~3) + 4; w++) {
            g_lo = min(g_lo, warp_keys[2 * w]);
            g_hi = max(g_hi, warp_keys[2 * w + 1]);
        }

    // wgmma: the descriptors' start addresses of this warpgroup's q tile and of stage 0's K.
    u32 q_desc = 0, kv_desc = 0;
    if constexpr (Wg::on) {
        // (The warpgroup by a shuffle: the compiler then knows it is the warp's, and keeps
        // the descriptors in uniform registers.)
        q_desc = Wg::at(qs + __shfl_sync(0xffffffffu, warp >> 2, 0) * 64 * hdp);
        kv_desc = Wg::at(kvs);
    }
    // A walking block after a shared tile's segments merges their states first, in segment
    // order, as it would have merged them had it computed them.
    const bool prior = !partial && seg_lo > 0;
    const bool one_segment = !prior && c_begin <= c_end && c_begin / FA_SEG_CHUNKS == c_end / FA_SEG_CHUNKS;
    if (prior && warp_live) {
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            if (16 * warp + g + 8 * rr >= n_rows) continue;
            const float* src = shared + ((long long)tok[rr] * heads + head[rr]) * shared_segs * (hd + 2);
            float merged[NT * 2];
#pragma unroll
            for (int n = 0; n < NT; n++) {
                merged[2 * n] = tot[(4 * n + 2 * rr) * 32 + lane];
                merged[2 * n + 1] = tot[(4 * n + 2 * rr + 1) * 32 + lane];
            }
            for (int s = 0; s < seg_lo; s++, src += hd + 2) {
                float part[NT * 2];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    const int d = 8 * n + 2 * t4;
                    part[2 * n] = d < hd ? src[2 + d] : 0.0f;
                    part[2 * n + 1] = d < hd ? src[3 + d] : 0.0f;
                }
                fa_merge<NT * 2>(tm[rr], tl[rr], merged, src[0], src[1], part);
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                tot[(4 * n + 2 * rr) * 32 + lane] = merged[2 * n];
                tot[(4 * n + 2 * rr + 1) * 32 + lane] = merged[2 * n + 1];
            }
        }
    }
    // Row rr's output: value(n, e) (output tile n, element e of the lane's pair) times inv,
    // stored as pairs (hd even: 8-byte aligned).
    auto store_out = [&](int rr, float inv, auto value) {
        float* o = out + ((long long)tok[rr] * heads + head[rr]) * hd;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int d = 8 * n + 2 * t4;
            if (d < hd) *reinterpret_cast<float2*>(o + d) = make_float2(__fmul_rn(value(n, 0), inv), __fmul_rn(value(n, 1), inv));
        }
    };
    for (int c = c_begin, stage = 0; c <= c_end; c++, stage ^= 1) {
        if (c < c_end) {
            load(c + 1, stage ^ 1);
            asm volatile("cp.async.commit_group;");
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        // This thread's cp.async stores, made visible to the tensor cores' reads (async proxy).
        if constexpr (Wg::on) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        const int c0 = c * FA_CHUNK - shift;
        const bool warp_in = warp_live && c0 < w_hi && c0 + FA_CHUNK > w_lo;
        // With wgmma a warpgroup multiplies together: each of its warps enters where one does.
        const bool group_in = Wg::on ? c0 < g_hi && c0 + FA_CHUNK > g_lo : warp_in;
        if (group_in) {
            const u16* ks = kvs + stage * 2 * FA_CHUNK * hdp;
            const u16* vs = ks + FA_CHUNK * hdp;
            // Scores: 16 rows x 64 keys, one chain over the dims a key tile.
            float s[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
            if constexpr (Wg::on) {
                // The warpgroup's chain, its q tile and K both read from shared memory.
                Wg::scores(s, q_desc, kv_desc + ((stage * 2 * FA_CHUNK * hdp * 2) >> 4));
            } else {
#pragma unroll
                for (int kk = 0; kk < MAX_HD / 16; kk++) {
                    if (kk >= ks_n) break;
                    // The warp's q fragment for these 16 dims (from shared memory each chunk:
                    // in registers it would cost 32 of them, and the full-width kernel would
                    // spill).
                    u32 a[4];
                    fa_ldsm_x4(a, qs + fa_at(16 * warp + (lane & 15), 16 * kk + 8 * (lane >> 4), hdp));
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) {
                        u32 b[4];
                        fa_ldsm_x4(b, ks + fa_kv_at(16 * jj + (lane & 7) + 8 * (lane >> 4),
                                                    16 * kk + 8 * ((lane >> 3) & 1), hdp));
                        fa_mma(s[2 * jj], a, b[0], b[1], s[2 * jj]);
                        fa_mma(s[2 * jj + 1], a, b[2], b[3], s[2 * jj + 1]);
                    }
                }
            }
            // Scale, mask (only where some row of the warp lacks some of the chunk's keys),
            // the chunk's maxima (rows g, g + 8). A warp outside the chunk (it entered with its
            // warpgroup) leaves its state as it was.
            bool keep[2] = {false, false};
            float alpha[2] = {1.0f, 1.0f};
            bool live_keeps = false;
            if (warp_in) {
                const bool masked = c0 < w_all_lo || c0 + FA_CHUNK > w_all_hi;
                float mx[2] = {NEG_INF, NEG_INF};
                if (masked) {
#pragma unroll
                    for (int j = 0; j < 8; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int rr = e >> 1, p = c0 + 8 * j + 2 * t4 + (e & 1);
                            const bool ok = p >= first[rr] && p < n_keys[rr];
                            s[j][e] = ok ? __fmul_rn(s[j][e], scale2) : NEG_INF;
                            mx[rr] = fmaxf(mx[rr], s[j][e]);
                        }
                } else {
#pragma unroll
                    for (int j = 0; j < 8; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            s[j][e] = __fmul_rn(s[j][e], scale2);
                            mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
                        }
                }
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
                    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
                    keep[rr] = mx[rr] == NEG_INF;  // none of the row's keys: its state stays
                    const float mn = fmaxf(m[rr], mx[rr]);
                    alpha[rr] = keep[rr] ? 1.0f : fa_exp2(m[rr] - mn);
                    m[rr] = mn;
                }
                live_keeps = (keep[0] && g < n_rows - 16 * warp) || (keep[1] && g + 8 < n_rows - 16 * warp);
            }
            // Where no live row of the warp keeps its state, every maximum is above -inf, so
            // 2^(s - m) of a masked score is already 0 and each row takes its MMA result: the
            // selects are dropped, the bits are the same.
            const bool selects = __any_sync(0xffffffffu, live_keeps);
            // The probabilities (rounded to bf16 by P V), the sums, the rescaled output.
            auto probabilities = [&](auto with_selects) {
                constexpr bool SEL = decltype(with_selects)::value;
                float sum[2] = {0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int rr = e >> 1;
                        s[j][e] = SEL && s[j][e] == NEG_INF ? 0.0f : fa_exp2(s[j][e] - m[rr]);
                        sum[rr] = __fadd_rn(sum[rr], s[j][e]);
                    }
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    sum[rr] = __fadd_rn(sum[rr], __shfl_xor_sync(0xffffffffu, sum[rr], 1));
                    sum[rr] = __fadd_rn(sum[rr], __shfl_xor_sync(0xffffffffu, sum[rr], 2));
                    l[rr] = __fadd_rn(__fmul_rn(l[rr], alpha[rr]), sum[rr]);
                }
                // The output rescaled where some row's maximum moved (a product with 1 is the
                // value itself: past a prompt's first chunks the maxima seldom move).
                if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[n][e] = __fmul_rn(acc[n][e], alpha[e >> 1]);
            };
            // Output += P V by mma.sync: four 16-key steps, P rounded to bf16.
            auto pv = [&](auto with_selects) {
                constexpr bool SEL = decltype(with_selects)::value;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    u32 a[4];
                    fa_p_frag(a, s, kk);
#pragma unroll
                    for (int nn = 0; nn < NT / 2; nn++) {
                        if (2 * nn >= nt_n) break;
                        u32 b[4];
                        fa_ldsm_x4_trans(b, vs + fa_kv_at(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                          16 * nn + 8 * (lane >> 4), hdp));
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            if constexpr (SEL) {
                                float d[4];
                                fa_mma(d, a, b[2 * h], b[2 * h + 1], acc[2 * nn + h]);
#pragma unroll
                                for (int e = 0; e < 4; e++) acc[2 * nn + h][e] = keep[e >> 1] ? acc[2 * nn + h][e] : d[e];
                            } else {
                                fa_mma(acc[2 * nn + h], a, b[2 * h], b[2 * h + 1], acc[2 * nn + h]);
                            }
                        }
                    }
                }
            };
            // wgmma's P V where every live warp of the warpgroup is in the chunk without selects.
            bool group_pv = false;
            if constexpr (Wg::on) group_pv = fa_group_all(!warp_live || (warp_in && !selects), 1 + (warp >> 2));
            if (group_pv) {
                if (warp_in) probabilities(FaBool<false>{});
                if constexpr (Wg::on) Wg::pv(acc, s, kv_desc + (((2 * stage + 1) * FA_CHUNK * hdp * 2) >> 4));
            } else if (warp_in && selects) {
                probabilities(FaBool<true>{});
                pv(FaBool<true>{});
            } else if (warp_in) {
                probabilities(FaBool<false>{});
                pv(FaBool<false>{});
            }
        }
        // A block of one segment: its state is the query's (a merge into the empty state
        // copies it), normalised into `out` here.
        if (!partial && one_segment && warp_live && c == c_end) {
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                if (16 * warp + g + 8 * rr < n_rows)
                    store_out(rr, 1.0f / l[rr], [&](int n, int e) { return acc[n][2 * rr + e]; });
            }
        }
        // A segment ends: merge its state into the query's, start the next one empty.
        if (!partial && !one_segment && warp_live && (c == c_end || (c + 1) % FA_SEG_CHUNKS == 0)) {
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                float part[NT * 2], merged[NT * 2];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    part[2 * n] = acc[n][2 * rr];
                    part[2 * n + 1] = acc[n][2 * rr + 1];
                    merged[2 * n] = tot[(4 * n + 2 * rr) * 32 + lane];
                    merged[2 * n + 1] = tot[(4 * n + 2 * rr + 1) * 32 + lane];
                }
                fa_merge<NT * 2>(tm[rr], tl[rr], merged, m[rr], l[rr], part);
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    tot[(4 * n + 2 * rr) * 32 + lane] = merged[2 * n];
                    tot[(4 * n + 2 * rr + 1) * 32 + lane] = merged[2 * n + 1];
                }
                m[rr] = NEG_INF;
                l[rr] = 0.0f;
            }
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
        }
        __syncthreads();  // the stage just read is the next load's
    }
    if (!warp_live || (!partial && one_segment)) return;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const int r = 16 * warp + g + 8 * rr;
        if (r >= n_rows) continue;
        if (partial) {
            float* dst = partial + (((long long)tok[rr] * heads + head[rr]) * max_segs + seg) * (hd + 2);
            if (t4 == 0) {
                dst[0] = m[rr];
                dst[1] = l[rr];
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const int d = 8 * n + 2 * t4;  // (hd and hd + 2 even: 8-byte aligned pairs)
                if (d < hd) *reinterpret_cast<float2*>(dst + 2 + d) = make_float2(acc[n][2 * rr], acc[n][2 * rr + 1]);
            }
        } else {
            store_out(rr, 1.0f / tl[rr], [&](int n, int e) { return tot[(4 * n + 2 * rr + e) * 32 + lane]; });
        }
    }
}

// A kernel of flash_impl: `Wg` FaMmaSync (flash_kernels.cuh's six) or FaWgmma (hopper.cu's).
#define FLASH_KERNEL(name, MAX_HD, FULL, WG)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * FA_MAX_WARPS) name(                                    \
        const float* q, float* out, float* partial, const Tok* toks, const RowKv* rows, const int* tiles,    \
        const float* shared, int shared_segs, int layer, int heads, int kv_heads, int hd, float scale,       \
        int splits, int window) {                                                                            \
        flash_impl<MAX_HD, FULL, WG>(q, out, partial, shared, shared_segs, toks, rows, tiles, layer, heads,   \
                                     kv_heads, hd, scale, splits, window);                                   \
    }
