#include "hpcckpt/persist.h"

#include <cstdint>

#include "arch.h"

namespace {

using LineFn = void (*)(const void*);

struct Barrier {
    LineFn line;
    const char* name;
    std::size_t line_bytes;
};

Barrier choose() {
    const hpcckpt::arch::Features f = hpcckpt::arch::detect();
#if defined(__x86_64__)
    if (f.clwb) return {hpcckpt::arch::line_clwb, "clwb", f.cache_line};
    if (f.clflushopt) return {hpcckpt::arch::line_clflushopt, "clflushopt", f.cache_line};
    if (f.clflush) return {hpcckpt::arch::line_clflush, "clflush", f.cache_line};
#elif defined(__aarch64__)
    // dc cvap traps on CPUs (and emulators) without DCPoP, so trust only HWCAP.
    if (f.dc_cvap) return {hpcckpt::arch::line_dc_cvap, "dc cvap", f.cache_line};
    if (f.dc_cvac) return {hpcckpt::arch::line_dc_cvac, "dc cvac", f.cache_line};
#endif
    return {nullptr, "none", f.cache_line};
}

const Barrier& barrier() {
    static const Barrier b = choose();
    return b;
}

}  // namespace

extern "C" const char* hpcckpt_barrier_kind(void) { return barrier().name; }

extern "C" size_t hpcckpt_cache_line_bytes(void) { return barrier().line_bytes; }

extern "C" void hpcckpt_persist_range(const void* data, size_t len) {
    const Barrier& b = barrier();
    if (b.line != nullptr && len != 0) {
        const std::uintptr_t mask = ~static_cast<std::uintptr_t>(b.line_bytes - 1);
        std::uintptr_t p = reinterpret_cast<std::uintptr_t>(data) & mask;
        const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(data) + len;
        for (; p < end; p += b.line_bytes) b.line(reinterpret_cast<const void*>(p));
    }
    hpcckpt::arch::fence();
}

extern "C" void hpcckpt_store_fence(void) { hpcckpt::arch::fence(); }
