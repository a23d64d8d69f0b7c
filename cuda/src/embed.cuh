// Embedding lookups widened to f32 (`embed_*`, quantized `embed_q*` and `embed_tcq*`). Host
// side: embed.rs. Part of kernels.cu's one compilation unit (included in order).

// Embedding rows widened to f32. grid: tokens, block: 256.
template <class W>
__device__ void embed_impl(const W table, const u32* tokens, int cols, float* out) {
    const long long row = (long long)tokens[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(long long)blockIdx.x * cols + c] = table.get(row + c);
}
extern "C" __global__ void embed_f32(const float* t, const u32* tok, int cols, float* out) { embed_impl<F32W>(F32W{t}, tok, cols, out); }
extern "C" __global__ void embed_bf16(const u16* t, const u32* tok, int cols, float* out) { embed_impl<Bf16W>(Bf16W{t}, tok, cols, out); }
extern "C" __global__ void embed_f16(const u16* t, const u32* tok, int cols, float* out) { embed_impl<F16W>(F16W{t}, tok, cols, out); }
#define EMBED_Q(NAME, BITS)                                                                               \
    extern "C" __global__ void NAME(const u32* q, const float* scale, const float* qbias, int group,       \
                                    const u32* tok, int cols, float* out) {                               \
        embed_impl<QW<BITS>>(QW<BITS>::of(q, scale, qbias, group), tok, cols, out);                           \
    }
EMBED_Q(embed_q2, 2)
EMBED_Q(embed_q4, 4)
EMBED_Q(embed_q8, 8)
// The same values from codes repacked for linear_tcq (`tcq_word`): QW's get, the word
// found through the repacked row.
template <int BITS>
__device__ void embed_tcq_impl(const u32* q, const float* scale, const float* qbias, int group, const u32* tok,
                               int cols, float* out) {
    const long long row = tok[blockIdx.x];
    const long long words = (long long)cols * BITS / 32;
    const int gshift = __ffs(group) - 1;  // 32, 64 or 128
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const u32 w = q[row * words + tcq_word<BITS>((long long)c * BITS / 32, cols / 32)];
        const u32 code = (w >> (c * BITS % 32)) & ((1u << BITS) - 1u);
        const long long g = (row * cols + c) >> gshift;
        out[(long long)blockIdx.x * cols + c] = dequantize(scale[g], qbias[g], code);
    }
}
extern "C" __global__ void embed_tcq4(const u32* q, const float* scale, const float* qbias, int group,
                                      const u32* tok, int cols, float* out) {
    embed_tcq_impl<4>(q, scale, qbias, group, tok, cols, out);
}
extern "C" __global__ void embed_tcq8(const u32* q, const float* scale, const float* qbias, int group,
                                      const u32* tok, int cols, float* out) {
    embed_tcq_impl<8>(q, scale, qbias, group, tok, cols, out);
}
