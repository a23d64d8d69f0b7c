// A forward's row and token layout, shared by kernels.cu and hopper.cu (both include it).
#pragma once

// A forward's layout, uploaded once: per token (row, logical position, RoPE position, first
// key it may read: 0 but for an assistant's explicit key range);
// per row (its block pool's address, units per plane of a block (elements; words of
// quantized K/V), committed length, window base slot, ring capacity, its block table (pool
// indices, in logical order), slots from one block to the next). A block holds
// 2 * layers planes [layer][K, V][KV_BLOCK slots][kv_heads * KvIo::units(hd)], so slot s
// of plane [layer][K, V] is slot table[s / KV_BLOCK] * block_slots + s % KV_BLOCK counted
// from that plane of the pool's first block (`kv_slot`): indexing `base + plane_offset`
// by it reads the row's blocks as if they were one contiguous buffer.
// A ring (sliding-window layers) keeps committed position p at slot p % ring; a plain
// store (ring 0) at slot p; the open window sits from window_base on in both.
#define KV_BLOCK 64
struct Tok {
    int row, pos, rope_pos, first;
};
struct RowKv {
    u64 base;
    long long plane;
    long long committed;
    long long window_base;
    long long ring;
    u64 table;
    long long block_slots;
};

// The row's slot of logical position p (before the block table).
__device__ __forceinline__ long long kv_held_slot(const RowKv& row, long long p) {
    if (p >= row.committed) return row.window_base + (p - row.committed);
    return row.ring ? p % row.ring : p;
}

// Slot s of the row as counted from its pool's first block.
__device__ __forceinline__ long long kv_block_slot(const RowKv& row, long long s) {
    const int block = reinterpret_cast<const int*>(row.table)[s / KV_BLOCK];
    return (long long)block * row.block_slots + s % KV_BLOCK;
}

__device__ __forceinline__ long long kv_slot(const RowKv& row, long long p) {
    return kv_block_slot(row, kv_held_slot(row, p));
}
