// The tensor-core attention's kernels (instances of flash.cuh's `FLASH_KERNEL`) and its
// merge (`flash_merge`). Host side: flash.rs. Part of kernels.cu's one compilation unit
// (included last).

// Attention on the tensor cores (bf16 activations and K/V).
#include "flash.cuh"

FLASH_KERNEL(flash_attention_32, 32, false, FaMmaSync)
FLASH_KERNEL(flash_attention_64, 64, false, FaMmaSync)
FLASH_KERNEL(flash_attention_128, 128, false, FaMmaSync)
FLASH_KERNEL(flash_attention_32_full, 32, true, FaMmaSync)
FLASH_KERNEL(flash_attention_64_full, 64, true, FaMmaSync)
FLASH_KERNEL(flash_attention_128_full, 128, true, FaMmaSync)

// Merges the segment states `flash_attention` stored in `partial` (tokens x heads x max_segs
// states of hd + 2 floats), in segment order, with `fa_merge`; lane j
// keeps dims j + 32 i. grid: (tokens, heads), block: 32.
extern "C" __global__ void flash_merge(const float* partial, float* out, int heads, int hd, int max_segs) {
    const int t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const float* src = partial + ((long long)t * heads + head) * max_segs * (hd + 2);
    float m = __int_as_float(0xff800000), l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < max_segs; s++) {
        const float* p = src + (long long)s * (hd + 2);
        float a[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = lane + 32 * i < hd ? p[2 + lane + 32 * i] : 0.0f;
        fa_merge<4>(m, l, acc, p[0], p[1], a);
    }
    float* o = out + ((long long)t * heads + head) * hd;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (lane + 32 * i < hd) o[lane + 32 * i] = __fmul_rn(acc[i], inv);
}
