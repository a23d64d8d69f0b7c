// Logit summaries (`logit_summaries`: each row's argmax, max and log-sum-exp). Host side:
// `Kernels::logit_summaries` (lib.rs). Part of kernels.cu's one compilation unit (included
// in order).

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
