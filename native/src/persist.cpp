#include "hpcckpt/persist.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "arch.h"

namespace {

using LineFn = void (*)(const void*);

struct Barrier {
    LineFn line;
    const char* name;
    std::size_t line_bytes;
};

// Candidates, best first, that this CPU reports it can execute.
std::vector<Barrier> supported() {
    const hpcckpt::arch::Features f = hpcckpt::arch::detect();
    std::vector<Barrier> c;
#if defined(__x86_64__)
    if (f.clwb) c.push_back({hpcckpt::arch::line_clwb, "clwb", f.cache_line});
    if (f.clflushopt) c.push_back({hpcckpt::arch::line_clflushopt, "clflushopt", f.cache_line});
    if (f.clflush) c.push_back({hpcckpt::arch::line_clflush, "clflush", f.cache_line});
#elif defined(__aarch64__)
    // dc cvap traps on CPUs without DCPoP, so it is used only when HWCAP says so.
    if (f.dc_cvap) c.push_back({hpcckpt::arch::line_dc_cvap, "dc cvap", f.cache_line});
    if (f.dc_cvac) c.push_back({hpcckpt::arch::line_dc_cvac, "dc cvac", f.cache_line});
#endif
    c.push_back({nullptr, "none", f.cache_line});
    return c;
}

// HPCCKPT_BARRIER names a weaker barrier than the best one: for emulators that
// report a feature they cannot execute (qemu-user 7.2 reports DCPoP but traps
// dc cvap). Names the CPU does not support are ignored.
Barrier choose() {
    const std::vector<Barrier> c = supported();
    const char* forced = std::getenv("HPCCKPT_BARRIER");
    if (forced != nullptr)
        for (const Barrier& b : c)
            if (std::strcmp(b.name, forced) == 0) return b;
    return c.front();
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
