// The tensor-core matmul's K walk, shared by kernels.cu and hopper.cu (see matmul_tc.cuh's
// "Canonical order of one output"): K in 128-wide chunks, chunk c in phase c % 8, the 8
// phases summed in phase order.

// Chunk (128 k) number i of the phase walk over nch chunks: phases 0..7 in order, phase p
// holding chunks p, p + 8, ..; the first nch % 8 phases hold one chunk more.
__device__ __forceinline__ int tt_chunk(int i, int nch) {
    const int q = nch / 8, rem = nch % 8, big = rem * (q + 1);
    if (i < big) return i / (q + 1) + 8 * (i % (q + 1));
    i -= big;
    return rem + i / q + 8 * (i % q);
}
