// Helpers every kernel family of kernels.cu shares: bf16/f16 widening and bf16 rounding, the
// weight readers (f32, bf16, f16 and MLX-quantized, `QW`; `tail8` for a K that 8 does not
// divide) and the warp reductions. Part of kernels.cu's one compilation unit, included first.

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Round to nearest even (the conversion torch and the CPU code use).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// Weight readers: a pointer (or, quantized, pointers and a layout) and how to widen
// element i (flat, row-major) or 8 consecutive elements from an 8-aligned index to f32.
struct F32W {
    static constexpr bool packed = false;
    typedef float T;
    const float* p;
    __device__ float get(long long i) const { return p[i]; }
    __device__ void get8(long long i, float* o) const {
        float4 a = *reinterpret_cast<const float4*>(p + i);
        float4 b = *reinterpret_cast<const float4*>(p + i + 4);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
};
// 8 consecutive 16-bit weights from an 8-aligned index, widened by `Widen`.
template <float (*Widen)(u16)>
__device__ __forceinline__ void widen8(const u16* p, long long i, float* o) {
    uint4 v = *reinterpret_cast<const uint4*>(p + i);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        o[2 * j] = Widen((u16)(w[j] & 0xffffu));
        o[2 * j + 1] = Widen((u16)(w[j] >> 16));
    }
}
struct Bf16W {
    static constexpr bool packed = false;
    typedef u16 T;
    const u16* p;
    __device__ float get(long long i) const { return bf16_to_f32(p[i]); }
    __device__ void get8(long long i, float* o) const { widen8<bf16_to_f32>(p, i, o); }
};
struct F16W {
    static constexpr bool packed = false;
    typedef u16 T;
    const u16* p;
    __device__ float get(long long i) const { return f16_to_f32(p[i]); }
    __device__ void get8(long long i, float* o) const { widen8<f16_to_f32>(p, i, o); }
};
// Values i .. i + 7 of w, zero from `left` on: the last chunk of a K that 8 does not divide.
// Out of line, so this rare path does not take the vector path's registers.
struct F8 {
    float v[8];
};
template <class W>
__device__ __noinline__ F8 tail8(const W w, long long i, int left) {
    F8 t;
#pragma unroll
    for (int j = 0; j < 8; j++) t.v[j] = j < left ? w.get(i + j) : 0.0f;
    return t;
}
// The 16 FP4 (E2M1) values of mxfp4: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__constant__ float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// MLX quantization: value i of a row-major rows x k matrix (g = i / group; rows hold whole
// groups), codes packed 32 / BITS to a u32 from the low bits up. Affine:
// scale[g] * q + bias[g], a multiply then an add, rounded each (never fused). mxfp4 (no
// biases): scale[g] * e2m1(q), exact (the scale is a power of two).
// An affine code's value: scale * code + bias, a multiply then an add, rounded each (never
// fused), as on the CPU: quantized weights and quantized K/V alike.
__device__ __forceinline__ float dequantize(float scale, float bias, u32 code) {
    return __fadd_rn(__fmul_rn(scale, (float)code), bias);
}

template <int BITS>
struct QW {
    static constexpr bool packed = true;
    const u32* q;
    const float* scale;
    const float* bias;
    int group;
    // log2(group) when it is a power of two (every size mlx writes), else -1: a shift in
    // place of a 64-bit division per lookup.
    int group_shift;
    // The one way to make a QW (group_shift derived, never left to a default).
    static __device__ QW of(const u32* q, const float* scale, const float* bias, int group) {
        return QW{q, scale, bias, group, (group & (group - 1)) == 0 ? __ffs(group) - 1 : -1};
    }
    __device__ long long group_of(long long i) const { return group_shift >= 0 ? i >> group_shift : i / group; }
    __device__ float get(long long i) const {
        const int per = 32 / BITS;
        const u32 w = q[i / per];
        const u32 code = (w >> ((int)(i % per) * BITS)) & ((1u << BITS) - 1u);
        const long long g = group_of(i);
        if (bias == nullptr) return __fmul_rn(scale[g], E2M1[code & 15u]);
        return dequantize(scale[g], bias[g], code);
    }
    // Values i .. i + 7 (i a multiple of 8): the same bits as eight get()s, with one group
    // lookup and the packed words read once (a group of 8k values holds all eight).
    __device__ void get8(long long i, float* o) const {
        if ((group & 7) != 0) {
            const F8 t = tail8(*this, i, 8);
#pragma unroll
            for (int j = 0; j < 8; j++) o[j] = t.v[j];
            return;
        }
        const long long g = group_of(i);
        const float s = scale[g];
        const float b = bias == nullptr ? 0.0f : bias[g];
        // 8 values are a quarter word (2-bit: at bit 0 or 16), one word, or two words.
        const u32* at = q + (i * BITS >> 5);
        const int shift = BITS == 2 ? (int)(i & 15) * 2 : 0;
        u32 words[BITS == 8 ? 2 : 1];
#pragma unroll
        for (int w = 0; w < (BITS == 8 ? 2 : 1); w++) words[w] = at[w];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int bit = shift + j * BITS;
            const u32 code = (words[BITS == 8 ? j / 4 : 0] >> (bit & 31)) & ((1u << BITS) - 1u);
            o[j] = bias == nullptr ? __fmul_rn(s, E2M1[code & 15u]) : dequantize(s, b, code);
        }
    }
};

// The one warp reduction: xor butterfly 16, 8, 4, 2, 1. Float addition is commutative,
// so every lane ends with the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
