// K/V store maintenance on raw units (`kv_move_*`, `kv_copy_*`). Host side: kv.rs. Part of
// kernels.cu's one compilation unit (included in order).

// KV store maintenance on raw units (4-byte words for f32 and quantized K/V, 2-byte for
// bf16).
//
// Moves slots [from, from + n) down to [to, to + n) of every plane (to < from, the ranges
// may overlap): one block per plane walks forward in chunks, all reads of a chunk before
// any write; writes land below every element not yet read. grid: planes, block: 256.
template <class E>
__device__ void kv_move_impl(E* base, long long plane, long long from, long long to, long long n) {
    E* p = base + (long long)blockIdx.x * plane;
    for (long long c = 0; c < n; c += blockDim.x) {
        const long long i = c + threadIdx.x;
        E v = i < n ? p[from + i] : E(0);
        __syncthreads();
        if (i < n) p[to + i] = v;
        __syncthreads();
    }
}
extern "C" __global__ void kv_move_4(u32* b, long long plane, long long from, long long to, long long n) {
    kv_move_impl<u32>(b, plane, from, to, n);
}
extern "C" __global__ void kv_move_2(u16* b, long long plane, long long from, long long to, long long n) {
    kv_move_impl<u16>(b, plane, from, to, n);
}

// Copies the first n elements of every plane from src (planes of src_plane elements) to
// dst (planes of dst_plane) and zeroes dst elements [zero_from, zero_to) (src may be dst
// when n is 0). grid: (blocks, planes).
template <class E>
__device__ void kv_copy_impl(const E* src, long long src_plane, E* dst, long long dst_plane, long long n,
                             long long zero_from, long long zero_to) {
    const E* s = src + (long long)blockIdx.y * src_plane;
    E* d = dst + (long long)blockIdx.y * dst_plane;
    const long long work = n + (zero_to > zero_from ? zero_to - zero_from : 0);
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < work;
         j += (long long)gridDim.x * blockDim.x) {
        if (j < n)
            d[j] = s[j];
        else
            d[zero_from + (j - n)] = E(0);
    }
}
extern "C" __global__ void kv_copy_4(const u32* s, long long sp, u32* d, long long dp, long long n, long long z0,
                                     long long z1) {
    kv_copy_impl<u32>(s, sp, d, dp, n, z0, z1);
}
extern "C" __global__ void kv_copy_2(const u16* s, long long sp, u16* d, long long dp, long long n, long long z0,
                                     long long z1) {
    kv_copy_impl<u16>(s, sp, d, dp, n, z0, z1);
}
