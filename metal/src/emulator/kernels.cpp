// kernels.metal (and selftest.metal) compiled as C++ for the emulator: the Metal shim, the
// kernels, and a table
// of invokers (one per kernel, listed by build.rs from the preprocessed source) that unpack
// an argument array into the kernel's parameters.
#include <cstddef>
#include <type_traits>
#include <utility>

#include <metal_stdlib>

#include "kernels.metal"
#include "selftest.metal"

namespace {

// Parameter i of type T: a buffer's address, a constant's bytes, or a built-in.
template <class T>
T argument(void* const* args, size_t i) {
    if constexpr (std::is_pointer_v<T>) {
        return static_cast<T>(args[i]);
    } else if constexpr (std::is_reference_v<T>) {
        return *static_cast<std::remove_reference_t<T>*>(args[i]);
    } else if constexpr (std::is_same_v<T, uint2>) {
        const mtp_emu::Position& p = mtp_emu::position();
        return uint2{p.group_x, p.group_y};
    } else {
        static_assert(std::is_same_v<T, uint>, "a by-value kernel parameter that is not a known built-in");
        return mtp_emu::position().index;
    }
}

template <class... A, size_t... I>
void call(void (*f)(A...), void* const* args, std::index_sequence<I...>) {
    f(argument<A>(args, I)...);
}

template <class... A>
void call(void (*f)(A...), void* const* args) {
    call(f, args, std::index_sequence_for<A...>{});
}

template <auto F>
void invoke(void* const* args) {
    call(F, args);
}

// Every kernel ends with its two built-ins (tests/metal_source.rs checks the sources).
template <class... A>
constexpr size_t bound_params(void (*)(A...)) {
    return sizeof...(A) - 2;
}

#define MTP_EMU_KERNEL(name) {#name, &invoke<&name>, bound_params(&name)},
const mtp_emu::KernelEntry KERNELS[] = {
#include "kernel_list.inc"
};

}  // namespace

extern "C" const mtp_emu::KernelEntry* mtp_emu_kernels(size_t* count) {
    *count = sizeof KERNELS / sizeof KERNELS[0];
    return KERNELS;
}
