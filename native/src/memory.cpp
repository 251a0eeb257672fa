#include "hpcckpt/memory.h"

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

extern "C" void* hpcckpt_aligned_alloc(size_t nbytes, size_t alignment, unsigned flags,
                                       hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
        hpcckpt_status_set(st, EINVAL, "posix_memalign", "", -1);
        return nullptr;
    }
    void* p = nullptr;
    // Huge: large blocks start on a huge-page boundary and ask for transparent
    // huge pages: 512x fewer page faults to prefault, fewer TLB misses in copies.
    constexpr size_t kHuge = 2u << 20;
    const bool huge = (flags & HPCCKPT_ALLOC_HUGE) != 0 && nbytes >= 2 * kHuge;
    if (huge && alignment < kHuge) alignment = kHuge;
    // A zero-byte request still returns a distinct, freeable pointer.
    int rc = posix_memalign(&p, alignment, nbytes == 0 ? alignment : nbytes);
    if (rc != 0) {
        hpcckpt_status_set(st, rc, "posix_memalign", "", -1);
        return nullptr;
    }
#ifdef MADV_HUGEPAGE
    if (huge) (void)madvise(p, nbytes & ~(kHuge - 1), MADV_HUGEPAGE);  // advice only; may be refused
#endif
    if ((flags & HPCCKPT_ALLOC_PREFAULT) != 0 && nbytes != 0) {
        const long page = sysconf(_SC_PAGESIZE);
        const size_t step = page > 0 ? static_cast<size_t>(page) : 4096u;
        auto* c = static_cast<volatile unsigned char*>(p);
        for (size_t i = 0; i < nbytes; i += step) c[i] = 0;
        c[nbytes - 1] = 0;
    }
    return p;
}

extern "C" void hpcckpt_aligned_free(void* p) { std::free(p); }

extern "C" unsigned hpcckpt_usable_cpus(void) {
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return static_cast<unsigned>(n);
    }
#endif
    return std::max(1u, std::thread::hardware_concurrency());
}

extern "C" void hpcckpt_parallel_copy(void* dst, const void* src, size_t len, unsigned threads) {
    // Below a few MiB a thread start costs more than it saves.
    constexpr size_t kMinPerThread = 4u << 20;
    if (threads == 0) {
        threads = static_cast<unsigned>(std::min<size_t>(hpcckpt_usable_cpus(), std::max<size_t>(1, len / kMinPerThread)));
    }
    if (threads <= 1 || len < 2 * 4096) {
        std::memcpy(dst, src, len);
        return;
    }
    // Split on 4 KiB boundaries so no two threads share a page or cache line.
    size_t part = (len / threads + 4095) & ~static_cast<size_t>(4095);
    std::vector<std::thread> pool;
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    size_t off = part;  // the caller's thread copies part 0
    for (unsigned t = 1; t < threads && off < len; ++t, off += part) {
        size_t n = std::min(part, len - off);
        pool.emplace_back([d, s, off, n] { std::memcpy(d + off, s + off, n); });
    }
    std::memcpy(d, s, std::min(part, len));
    for (auto& th : pool) th.join();
}
