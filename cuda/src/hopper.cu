// Hopper (sm_90a) kernels, a module of their own (compiled for compute_90a, loaded only on
// a GPU of compute capability 9.0): the tensor-core matmul for many tokens by wgmma, its
// operands brought into shared memory by the tensor memory accelerator (TMA).
//
// Every output is summed in matmul_tc.cuh's canonical order (walk.cuh's phases, 128-wide
// chunks, two 16-k MMA steps a 32-wide block), so with the bits of every other tensor-core
// kernel: a wgmma over 16 k gives the bits of mma.sync over the same 16 k, whichever
// register or shared-memory place holds which k (cuda/probes/mma_bits.cu). The weights'
// fragments come from registers, loaded as linear_tc loads them (lane 4g + t: k 8t..8t+7 of
// rows g and g + 8 a block); the activations come from shared memory, written by
// split_activations_steps in the matching order. bf16 activations only (the `_x1`
// numerics); the exact three-term split keeps matmul_tt.cuh's tiles.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#include "walk.cuh"

// A TMA descriptor (CUtensorMap), made by the host and passed by value.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

// A block: 128 weight rows (output columns) x 192, 128 or 64 tokens, K staged 64 at a time,
// WG_STAGES deep: the weights as two 32-k boxes of 128 rows x 64 bytes (rows g and g + 1 of a
// warp's loads side by side: no bank conflicts), the tokens as one box of 128-byte rows in
// the 128-byte swizzle wgmma reads. Warpgroup 0 issues the loads (one thread); warpgroups 1
// and 2 each multiply 64 weight rows by the tokens (wgmma m64n192k16, m64n128k16 or
// m64n64k16) and hold the phase's sum and the running sum.
#define WG_COLS 128
#define WG_K 64
#define WG_STAGES 4
#define WG_BOX_BYTES (WG_COLS * 32 * 2)
#define WG_W_BYTES (2 * WG_BOX_BYTES)

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
}
// The box at (k, row) of `map` into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, u64* bar, int k, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"((u64)map), "r"(k), "r"(row), "r"(smem_addr(bar))
        : "memory");
}
// A shared-memory matrix descriptor's start address (16-byte units) of `p`: that of p + b
// bytes is this + b / 16 (every shared address fits the field's 14 bits), so a kernel
// computes it once and adds constants.
__device__ __forceinline__ u32 desc_addr(const void* p) { return (smem_addr(p) & 0x3FFFF) >> 4; }
// A K-major operand tile in the 128-byte swizzle (rows of 128 bytes, 8-row groups 1,024
// bytes apart) at start address `addr`; + 2 j addresses its k 16 j..16 j + 15.
// (The fields are added, not or-ed, to the address: the compiler then folds a constant
// offset of it and theirs into one add.)
__device__ __forceinline__ u32 desc_hi(u32 stride_bytes) { return (stride_bytes >> 4) | (1u << 30); }
__device__ __forceinline__ u64 sw128_desc(u32 addr) { return (u64)(addr + (1u << 16)) | ((u64)desc_hi(1024) << 32); }
__device__ __forceinline__ u64 sw128_desc(const void* p) { return sw128_desc(desc_addr(p)); }
// An MN-major operand in the 128-byte swizzle read transposed (attention's V: rows of 64
// dims, 128 bytes): 8-row (k) groups 1,024 bytes apart, 64-column blocks `block_bytes` apart.
__device__ __forceinline__ u64 sw128_desc_mn(u32 addr, u32 block_bytes) {
    return (u64)(addr + ((block_bytes >> 4) << 16)) | ((u64)desc_hi(1024) << 32);
}
// d (+)= a b over 16 k: a, this lane's fragment of 64 weight rows (mma.sync's A layout,
// warp w holding rows 16 w..), b the tokens' tile in shared memory (128 tokens, or 64:
// m64n192k16, m64n128k16 or m64n64k16, d holding half as many floats as there are tokens).
__device__ __forceinline__ void wgmma_tile(float (&d)[96], u32 a0, u32 a1, u32 a2, u32 a3, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}
// TRANS_B: b read transposed (MN-major: attention's V).
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_tile(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "n"(TRANS_B));
}
__device__ __forceinline__ void wgmma_tile(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}
// d (+)= a b over 16 k, both operands K-major tiles in shared memory (m64n64k16).
__device__ __forceinline__ void wgmma_tile_ss(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across a wait.
template <int D>
__device__ __forceinline__ void fence_regs(float (&d)[D]) {
#pragma unroll
    for (int i = 0; i < D; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The K walk: chunks in walk.cuh's order (tt_chunk: phases 0..7 in turn, phase p's chunks
// p, p + 8, ..), each two 64-k stages; with `phase` >= 0 that phase's chunks alone. Stepped
// from one chunk to the next, not by tt_chunk's division a chunk (14% fewer instructions in
// the 128 x 192 tile; its time within the spread, notes v33). K % 128 == 0 (the host's
// condition), so every chunk is whole.
struct WgWalk {
    int nch, i, c, phase;
    __device__ WgWalk(int k, int phase) : nch(k / 128), i(0), c(phase < 0 ? 0 : phase), phase(phase) {}
    __device__ bool more() const { return phase < 0 ? i < nch : c < nch; }
    __device__ int kb(int h) const { return 128 * c + 64 * h; }
    __device__ bool ends_phase() const { return c + 8 >= nch; }
    __device__ void next() {
        i++;
        // Past a phase's last chunk, the next phase's first (phase p's chunks are p mod 8).
        c = phase >= 0 || c + 8 < nch ? c + 8 : (c & 7) + 1;
    }
};

// This lane's weight fragments of a stage (`w`: its two 32-k boxes): k 8t..8t+7 of rows g
// and g + 8 (`row`, `row` + 8) of each box, as linear_tc loads them.
struct WgFrag {
    uint4 lo[2], hi[2];
    __device__ void load(const unsigned char* w, int row, int t) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            lo[u] = *reinterpret_cast<const uint4*>(w + u * WG_BOX_BYTES + row * 64 + 16 * t);
            hi[u] = *reinterpret_cast<const uint4*>(w + u * WG_BOX_BYTES + (row + 8) * 64 + 16 * t);
        }
    }
    // The stage's 4 MMA steps: block u, step s (linear_tc's a.x, a8.x, a.y, a8.y in step 0,
    // .z, .w in step 1) against the tokens' stored k 16 (2u + s)...
    template <int D>
    __device__ void mma(float (&d)[D], u64 db) const {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            wgmma_tile(d, lo[u].x, hi[u].x, lo[u].y, hi[u].y, db + 2 * (2 * u));
            wgmma_tile(d, lo[u].z, hi[u].z, lo[u].w, hi[u].w, db + 2 * (2 * u + 1));
        }
    }
};

// out (+)= x w^T + bias for x (m x k, bf16: split_activations_steps) and w (n x k, bf16),
// k % 128 == 0, through their TMA maps (w: boxes of 32 k x 128 rows, no swizzle; x: 64 k x
// TOKS tokens, 128-byte swizzle; zeros past the edges), a block the tile (`tile_c`,
// `tile_t`). PHASED: the block walks phase `phase`'s chunks alone and writes that phase's
// partial to out[phase][m][n] (no bias), for linear_merge_phases to add in phase order, as
// matmul_tt.cuh's phase-split tiles do. block: 384; dynamic shared memory: WG_STAGES stages of
// (128 + TOKS) x 64 bf16 + 1,024 (alignment) + the barriers.
template <int TOKS, bool PHASED>
__device__ __forceinline__ void linear_wg_impl(const TensorMap& wmap, const TensorMap& xmap, int m, int k, int n,
                                               const float* __restrict__ bias, float* __restrict__ out,
                                               int accumulate, int tile_c, int tile_t, int phase) {
    constexpr int STAGE_BYTES = (WG_COLS + TOKS) * WG_K * 2, D = TOKS / 2;
    extern __shared__ unsigned char wg_raw[];
    unsigned char* base = wg_raw + ((1024 - (smem_addr(wg_raw) & 1023)) & 1023);
    u64* full = reinterpret_cast<u64*>(base + WG_STAGES * STAGE_BYTES);
    u64* empty = full + WG_STAGES;
    const int wg = threadIdx.x / 128;
    const int col0 = tile_c * WG_COLS, tok0 = tile_t * TOKS;
    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);  // one arrival a consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        // 192-token tiles: 96 + 96 sums a multiplying thread, which takes 240 registers.
        if constexpr (!PHASED) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(TOKS > 128 ? 24 : 40));
        if (threadIdx.x == 0) {
            int s = 0;
            for (WgWalk at(k, phase); at.more(); at.next())
                for (int h = 0; h < 2; h++, s++) {
                    const int slot = s % WG_STAGES, round = s / WG_STAGES;
                    if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
                    unsigned char* st = base + slot * STAGE_BYTES;
                    mbar_expect_tx(&full[slot], STAGE_BYTES);
                    tma_load(st, &wmap, &full[slot], at.kb(h), col0);
                    tma_load(st + WG_BOX_BYTES, &wmap, &full[slot], at.kb(h) + 32, col0);
                    tma_load(st + WG_W_BYTES, &xmap, &full[slot], at.kb(h), tok0);
                }
        }
        return;
    }
    if constexpr (!PHASED) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(TOKS > 128 ? 240 : 232));
    const int cw = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row = 64 * cw + 16 * warp + g;
    float acc[D], sum[PHASED ? 1 : D];  // a phase block keeps no running sum
#pragma unroll
    for (int i = 0; i < D; i++) acc[i] = 0.0f;
    // A chunk's two stages load their weight fragments into two register sets: a stage's
    // stay untouched until its MMAs are done (the wait_group 1 after the next stage's MMAs
    // are queued).
    WgFrag first, second;
    int s = 0, held = -1;  // held: the slot whose MMAs may still run
    // A stage: its fragments loaded, its 4 MMAs queued, the slot before it released.
    auto stage = [&](WgFrag& frag) {
        const int slot = s % WG_STAGES;
        mbar_wait(&full[slot], (s / WG_STAGES) & 1);
        unsigned char* st = base + slot * STAGE_BYTES;
        frag.load(st, row, t);
        wgmma_fence();
        frag.mma(acc, sw128_desc(st + WG_W_BYTES));
        wgmma_commit();
        wgmma_wait<1>();
        if (held >= 0 && lane == 0) mbar_arrive(&empty[held]);
        held = slot;
        s++;
    };
    WgWalk at(k, phase);
    while (at.more()) {
        // One phase: its chunks' MMAs queued back to back.
        int c;
        bool ends;
        do {
            stage(first);
            stage(second);
            c = at.c;
            ends = at.ends_phase();
            at.next();
        } while (!ends);
        wgmma_wait<0>();
        fence_regs(acc);
        if (lane == 0) mbar_arrive(&empty[held]);
        held = -1;
        // The end of a phase: its partial joins the running sum, as linear_tc's warp sums do
        // (a phase block's one phase ends its walk: its partial is acc).
        if constexpr (!PHASED) {
#pragma unroll
            for (int i = 0; i < D; i++) {
                sum[i] = (c & 7) == 0 ? acc[i] : sum[i] + acc[i];
                acc[i] = 0.0f;
            }
            fence_regs(acc);
        }
    }
    // Phases without chunks (K < 1024) add linear_tc's idle warps' zeros (a phase block
    // without chunks writes zeros).
    if constexpr (!PHASED)
        for (int p = at.nch; p < 8; p++)
#pragma unroll
            for (int i = 0; i < D; i++) sum[i] = sum[i] + 0.0f;
    // D: acc/sum[4 j + e] = (weight row 16 warp + g + 8 (e / 2), token 8 j + 2 t + e % 2).
#pragma unroll
    for (int i = 0; i < D; i++) {
        const int j = i / 4, e = i % 4;
        const int col = col0 + 64 * cw + 16 * warp + g + 8 * (e >> 1);
        const int r = tok0 + 8 * j + 2 * t + (e & 1);
        if (r >= m || col >= n) continue;
        if constexpr (PHASED) {
            out[((long long)phase * m + r) * n + col] = acc[i];
        } else {
            float y = sum[i];
            if (bias) y += bias[col];
            float* o = out + (long long)r * n + col;
            *o = accumulate ? *o + y : y;
        }
    }
}

// 128 x 128 tiles: grid (ceil(m / 128), ceil(n / 128)) with `tokens_first`, else
// (ceil(n / 128), ceil(m / 128)). The grid's x walks the smaller operand's tiles (the
// tokens' when the weight has more rows than there are tokens), so the blocks running at
// once share a few tiles of the larger, each read from DRAM once, while the smaller stays in
// L2.
//
// 128 x 192 tiles, the same grid in 192-token tiles: 24 KB read from L2 per 1 M MACs
// against the 128 x 128 tiles' 32, and 1.5 times the MMA work per fragment load and wait
// (H100: 10-15% faster at 2,048 and 4,096 tokens; fewer blocks to fill the GPU below).
#define WG_PLAIN_KERNEL(name, TOKS)                                                                           \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                      \
        name(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap, int m, int k,    \
             int n, const float* __restrict__ bias, float* __restrict__ out, int accumulate, int tokens_first) { \
        const int tile_c = tokens_first ? blockIdx.y : blockIdx.x;                                            \
        const int tile_t = tokens_first ? blockIdx.x : blockIdx.y;                                            \
        linear_wg_impl<TOKS, false>(wmap, xmap, m, k, n, bias, out, accumulate, tile_c, tile_t, -1);          \
    }
WG_PLAIN_KERNEL(linear_wg_bf16_128x128_x1, 128)
WG_PLAIN_KERNEL(linear_wg_bf16_128x192_x1, 192)

// 128 weight rows x 64 (128) tokens, a block a phase: grid (ceil(n / 128), 8 ceil(m / 64
// (128))), y = 8 token tile + phase; `part` takes the 8 phases' partials (8 m n). For
// verifies of 33-128 tokens, whose plain grid would leave most of the GPU idle: with 64
// tokens two blocks an SM.
extern "C" __global__ void __launch_bounds__(384, 2)
    linear_wg_phases_bf16_128x64_x1(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,
                                    int m, int k, int n, float* __restrict__ part) {
    linear_wg_impl<64, true>(wmap, xmap, m, k, n, nullptr, part, 0, blockIdx.x, blockIdx.y / 8, blockIdx.y % 8);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    linear_wg_phases_bf16_128x128_x1(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,
                                     int m, int k, int n, float* __restrict__ part) {
    linear_wg_impl<128, true>(wmap, xmap, m, k, n, nullptr, part, 0, blockIdx.x, blockIdx.y / 8, blockIdx.y % 8);
}

// Up to 3 weights of one K over the same activations in one launch of the 128x64 phase
// tiles (q/k/v past 32 tokens: the narrow k and v alone would leave most SMs idle): grid
// x's tiles [first_tile[i], first_tile[i + 1]) are part i's 128-column tiles, each writing
// its phases' partials to part[i] (8 m n[i]) as its own launch would, so the merge gives
// each output its bits. Missing parts' maps repeat the first's (never read).
struct WgParts {
    float* part[3];
    int n[3];
    int first_tile[3];
    int parts;
};
extern "C" __global__ void __launch_bounds__(384, 2)
    linear_wg_phases_parts_bf16_128x64_x1(const __grid_constant__ TensorMap w0, const __grid_constant__ TensorMap w1,
                                          const __grid_constant__ TensorMap w2,
                                          const __grid_constant__ TensorMap xmap, int m, int k,
                                          const __grid_constant__ WgParts p) {
    const int b = blockIdx.x;
    const int i = (p.parts > 2 && b >= p.first_tile[2]) ? 2 : (p.parts > 1 && b >= p.first_tile[1]) ? 1 : 0;
    // Chosen by conditionals, as matmul_tc.cuh's TC_PART (a dynamic index would copy to the stack).
    const TensorMap* w = i == 0 ? &w0 : i == 1 ? &w1 : &w2;
    float* part = i == 0 ? p.part[0] : i == 1 ? p.part[1] : p.part[2];
    const int n = i == 0 ? p.n[0] : i == 1 ? p.n[1] : p.n[2];
    const int first = i == 0 ? p.first_tile[0] : i == 1 ? p.first_tile[1] : p.first_tile[2];
    linear_wg_impl<64, true>(*w, xmap, m, k, n, nullptr, part, 0, b - first, blockIdx.y / 8, blockIdx.y % 8);
}

// Attention's wgmma (flash.cuh, `Wg` = FaWgmma): a warpgroup's 64 (token, head) rows, warp w
// holding rows 16 w.. in mma.sync's layouts, so each row's softmax runs as in the mma.sync
// kernel. K and V are a chunk's tiles in fa_kv_at's layout: 64-dim blocks of 64 keys x 128
// bytes in the 128-byte swizzle.
#include "forward.cuh"
#include "flash.cuh"

struct FaWgmma {
    static constexpr bool on = true;
    // The descriptors' start address of a tile at `p` (flash_impl takes them once, then adds).
    __device__ static u32 at(const void* p) { return desc_addr(p); }
    // s = q K^T over a chunk's 64 keys: 8 m64n64k16 over the dims in increasing 16-wide
    // steps (mma.sync's chain), the warpgroup's q tile (64 rows) at `q` and K at `k`, both
    // in shared memory in fa_kv_at's layout.
    __device__ static void scores(float (&s)[8][4], u32 q, u32 k) {
        float(&d)[32] = reinterpret_cast<float(&)[32]>(s);
        fence_regs(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            const u32 step = fa_kv_at(0, 16 * kk, 128) / 8;  // dims 16 kk.. of row 0
            wgmma_tile_ss(d, sw128_desc(q + step), sw128_desc(k + step));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(d);
    }
    // acc += P V over the chunk's four 16-key steps (P rounded to bf16 as mma.sync's path
    // rounds it), V at `v` in shared memory read transposed: its 16 keys' rows, the two
    // 64-dim blocks a chunk's 64 rows of 128 bytes apart.
    __device__ static void pv(float (&acc)[16][4], const float (&s)[8][4], u32 v) {
        u32 a[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) fa_p_frag(a[kk], s, kk);
        float(&d)[64] = reinterpret_cast<float(&)[64]>(acc);
        fence_regs(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_tile<1>(d, a[kk][0], a[kk][1], a[kk][2], a[kk][3], sw128_desc_mn(v + fa_kv_at(16 * kk, 0, 128) / 8, FA_CHUNK * 128));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(d);
    }
};

// The full-width (head size 128) tensor-core attention with wgmma, for tiles that fill a
// warpgroup (flash.rs picks it); the same bits as flash_attention_128_full.
FLASH_KERNEL(flash_attention_128_wg, 128, true, FaWgmma)
