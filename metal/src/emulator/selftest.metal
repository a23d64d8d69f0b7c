// Kernels that test the emulator itself (tests/metal_emulated.rs), compiled into it beside
// kernels.metal but never into a real Metal library.
#include <metal_stdlib>
using namespace metal;

// out[i] = x[255 - i] within each threadgroup of 256, through threadgroup memory.
kernel void selftest_reverse(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                             uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float shared_x[256];
    shared_x[tid] = x[group.x * 256 + tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[group.x * 256 + tid] = shared_x[255 - tid];
}

// The same without the barrier: wrong on a GPU, and wrong on the emulator too.
kernel void selftest_reverse_unsynchronized(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                            uint2 group [[threadgroup_position_in_grid]],
                                            uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float shared_x[256];
    shared_x[tid] = x[group.x * 256 + tid];
    out[group.x * 256 + tid] = shared_x[255 - tid];
}

// Per SIMD-group of 64-thread threadgroups: out[3 i] = the sum of the group's 32 values
// (xor butterfly), out[3 i + 1] = lane 7's value, out[3 i + 2] = lane (i ^ 5)'s value.
kernel void selftest_simd(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    const uint i = group.x * 64 + tid;
    float v = x[i];
    for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
    out[3 * i] = v;
    out[3 * i + 1] = simd_shuffle(x[i], ushort(7));
    out[3 * i + 2] = simd_shuffle_xor(x[i], ushort(5));
}

// Thread 0 returns while the others wait at a barrier: a hang (or worse) on a GPU.
kernel void selftest_divergent_barrier(device float* out [[buffer(0)]], uint2 group [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]]) {
    if (tid == 0) return;
    threadgroup_barrier(mem_flags::mem_device);
    out[tid] = 1.0f;
}

// Writes one float past `n`.
kernel void selftest_write_past_end(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                                    uint2 group [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
    if (tid == 0) out[n] = 1.0f;
}
