// A forward's row and token layout, shared by kernels.cu and hopper.cu (both include it).
#pragma once

// A forward's layout, uploaded once: per token (row, logical position, RoPE position, first
// key it may read: 0 but for an assistant's explicit key range);
// per row (K/V buffer address, units per plane (elements; words of quantized K/V),
// committed length, window base slot, ring capacity). A row's buffer holds 2 * layers
// planes [layer][K, V][slot][kv_heads * KvIo::units(hd)].
// A ring (sliding-window layers) keeps committed position p at slot p % ring; a plain
// store (ring 0) at slot p; the open window sits from window_base on in both.
struct Tok {
    int row, pos, rope_pos, first;
};
struct RowKv {
    u64 base;
    long long plane;
    long long committed;
    long long window_base;
    long long ring;
};

__device__ __forceinline__ long long kv_slot(const RowKv& row, long long p) {
    if (p >= row.committed) return row.window_base + (p - row.committed);
    return row.ring ? p % row.ring : p;
}
