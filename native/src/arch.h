// The only place that knows about instruction sets. Everything here is
// selected at run time: the shipped binary targets the baseline ISA and
// enables newer instructions per function, behind a feature check.
#ifndef HPCCKPT_ARCH_H
#define HPCCKPT_ARCH_H

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define HPCCKPT_HAVE_CRC_HW 1
#define HPCCKPT_CRC_TARGET __attribute__((target("sse4.2")))
#elif defined(__aarch64__)
#include <arm_acle.h>
#include <sys/auxv.h>
#define HPCCKPT_HAVE_CRC_HW 1
#define HPCCKPT_CRC_TARGET __attribute__((target("arch=armv8-a+crc")))
#else
#define HPCCKPT_HAVE_CRC_HW 0
#define HPCCKPT_CRC_TARGET
#endif

namespace hpcckpt::arch {

struct Features {
    bool crc32c = false;      // sse4.2 crc32 / armv8 CRC32 extension
    bool clwb = false;
    bool clflushopt = false;
    bool clflush = false;
    bool dc_cvap = false;     // ARMv8.2 DCPoP
    bool dc_cvac = false;     // baseline ARMv8
    std::size_t cache_line = 64;
};

inline Features detect() {
    Features f;
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        f.crc32c = (c & bit_SSE4_2) != 0;
        f.clflush = (d & (1u << 19)) != 0;
        if (f.clflush) {
            // CPUID.1:EBX[15:8] is the CLFLUSH line size in 8-byte units.
            unsigned words = (b >> 8) & 0xffu;
            if (words != 0) f.cache_line = static_cast<std::size_t>(words) * 8u;
        }
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f.clflushopt = (b & (1u << 23)) != 0;
        f.clwb = (b & (1u << 24)) != 0;
    }
#elif defined(__aarch64__)
    unsigned long hw = getauxval(AT_HWCAP);
    // Bit values from the kernel's uapi hwcap.h; spelled out so that older
    // C libraries without the macros still build.
    f.crc32c = (hw & (1ul << 7)) != 0;   // HWCAP_CRC32
    f.dc_cvap = (hw & (1ul << 16)) != 0; // HWCAP_DCPOP
    f.dc_cvac = true;
    std::uint64_t ctr = 0;
    asm volatile("mrs %0, ctr_el0" : "=r"(ctr));
    f.cache_line = static_cast<std::size_t>(4u) << ((ctr >> 16) & 0xfu);
#endif
    return f;
}

inline std::uint64_t load_u64(const unsigned char* p) {
    std::uint64_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__x86_64__)
HPCCKPT_CRC_TARGET inline std::uint32_t crc_u8(std::uint32_t c, unsigned char v) {
    return _mm_crc32_u8(c, v);
}
HPCCKPT_CRC_TARGET inline std::uint32_t crc_u64(std::uint32_t c, std::uint64_t v) {
    return static_cast<std::uint32_t>(_mm_crc32_u64(c, v));
}
#elif defined(__aarch64__)
HPCCKPT_CRC_TARGET inline std::uint32_t crc_u8(std::uint32_t c, unsigned char v) {
    return __crc32cb(c, v);
}
HPCCKPT_CRC_TARGET inline std::uint32_t crc_u64(std::uint32_t c, std::uint64_t v) {
    return __crc32cd(c, v);
}
#endif

// Cache write-back of one line; each variant needs its own feature check.
#if defined(__x86_64__)
__attribute__((target("clwb"))) inline void line_clwb(const void* p) {
    _mm_clwb(const_cast<void*>(p));
}
__attribute__((target("clflushopt"))) inline void line_clflushopt(const void* p) {
    _mm_clflushopt(const_cast<void*>(p));
}
inline void line_clflush(const void* p) { _mm_clflush(p); }
inline void fence() { _mm_sfence(); }
#elif defined(__aarch64__)
// "sys #3, c7, c12, #1" is dc cvap spelled so that a baseline assembler accepts it.
inline void line_dc_cvap(const void* p) { asm volatile("sys #3, c7, c12, #1, %0" ::"r"(p) : "memory"); }
inline void line_dc_cvac(const void* p) { asm volatile("dc cvac, %0" ::"r"(p) : "memory"); }
inline void fence() { asm volatile("dsb ish" ::: "memory"); }
#else
inline void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

}  // namespace hpcckpt::arch

#endif
