// The contract between the Metal shim (metal_stdlib, compiled into the kernels' translation
// unit) and the scheduler (scheduler.cpp): what a kernel thread may ask of the emulator.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mtp_emu {

// Where the running kernel thread sits in its dispatch.
struct Position {
    uint32_t group_x, group_y;  // threadgroup_position_in_grid
    uint32_t index;             // thread_index_in_threadgroup (threadgroups are 1-D)
    uint32_t threads;           // threads_per_threadgroup
};

// Set by the scheduler each time it switches to a kernel thread: its position, and the
// exchange buffer of its SIMD-group for the current generation (see simd_scratch).
extern __thread const Position* current_position;
extern __thread unsigned char* current_scratch;

// The running thread's position.
inline const Position& position() { return *current_position; }
// Blocks until every thread of the threadgroup that has not returned reaches a barrier.
void threadgroup_barrier();
// Blocks until every lane of the running thread's SIMD-group (32 lanes) that has not
// returned reaches this point; lanes exchange values through `simd_scratch`.
void simdgroup_barrier();
// 32 slots of 16 bytes shared by the running thread's SIMD-group, one buffer per
// simdgroup_barrier generation (two in turn, so a lane may write the next exchange while
// another still reads this one).
inline unsigned char* simd_scratch() { return current_scratch; }
// One kernel: a function that unpacks `args` (one pointer per parameter that is not a
// built-in: a buffer's address, or the address of a constant's bytes) and runs one thread.
typedef void (*Invoker)(void* const* args);
struct KernelEntry {
    const char* name;
    Invoker invoke;
    size_t params;  // parameters that are not built-ins (the arguments a dispatch binds)
};

}  // namespace mtp_emu
