// CRC-32C. The hardware path runs three independent crc32 streams at once
// (the instruction has a 3-cycle latency but issues every cycle) and merges
// them with precomputed "shift by N zero bytes" tables.
#include "hpcckpt/crc32c.h"

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "arch.h"

namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli

struct SliceTables {
    std::uint32_t t[8][256];
};

SliceTables make_slice_tables() {
    SliceTables s{};
    for (std::uint32_t n = 0; n < 256; ++n) {
        std::uint32_t c = n;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
        s.t[0][n] = c;
    }
    for (std::uint32_t n = 0; n < 256; ++n) {
        std::uint32_t c = s.t[0][n];
        for (int k = 1; k < 8; ++k) {
            c = s.t[0][c & 0xffu] ^ (c >> 8);
            s.t[k][n] = c;
        }
    }
    return s;
}

const SliceTables& slice() {
    static const SliceTables tables = make_slice_tables();
    return tables;
}

// Raw register update (no pre/post inversion), slicing-by-8.
std::uint32_t sw_raw(std::uint32_t c, const unsigned char* p, std::size_t n) {
    const auto& t = slice().t;
    while (n != 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
        c = t[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
        --n;
    }
    while (n >= 8) {
        std::uint64_t v = hpcckpt::arch::load_u64(p) ^ c;
        c = t[7][v & 0xffu] ^ t[6][(v >> 8) & 0xffu] ^ t[5][(v >> 16) & 0xffu] ^
            t[4][(v >> 24) & 0xffu] ^ t[3][(v >> 32) & 0xffu] ^ t[2][(v >> 40) & 0xffu] ^
            t[1][(v >> 48) & 0xffu] ^ t[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n-- != 0) c = t[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
    return c;
}

#if HPCCKPT_HAVE_CRC_HW

// Register after feeding `len` zero bytes, as a table per input byte lane.
struct ShiftTable {
    std::uint32_t t[4][256];
};

ShiftTable make_shift(std::size_t len) {
    const auto& t0 = slice().t[0];
    std::uint32_t basis[32];
    for (unsigned bit = 0; bit < 32; ++bit) {
        std::uint32_t c = 1u << bit;
        for (std::size_t i = 0; i < len; ++i) c = t0[c & 0xffu] ^ (c >> 8);
        basis[bit] = c;
    }
    ShiftTable s{};
    for (unsigned lane = 0; lane < 4; ++lane) {
        for (unsigned b = 0; b < 256; ++b) {
            std::uint32_t v = 0;
            for (unsigned k = 0; k < 8; ++k)
                if ((b >> k) & 1u) v ^= basis[lane * 8 + k];
            s.t[lane][b] = v;
        }
    }
    return s;
}

constexpr std::size_t kLong = 8192;
constexpr std::size_t kShort = 256;

const ShiftTable& shift_long() {
    static const ShiftTable s = make_shift(kLong);
    return s;
}
const ShiftTable& shift_short() {
    static const ShiftTable s = make_shift(kShort);
    return s;
}

inline std::uint32_t shift(const ShiftTable& s, std::uint32_t c) {
    return s.t[0][c & 0xffu] ^ s.t[1][(c >> 8) & 0xffu] ^ s.t[2][(c >> 16) & 0xffu] ^
           s.t[3][c >> 24];
}

// Three interleaved streams over [p, p + 3*block), merged into c0.
HPCCKPT_CRC_TARGET std::uint32_t hw_three_way(std::uint32_t c0, const unsigned char* p,
                                              std::size_t block, const ShiftTable& s) {
    using hpcckpt::arch::crc_u64;
    using hpcckpt::arch::load_u64;
    std::uint32_t c1 = 0, c2 = 0;
    const unsigned char* end = p + block;
    while (p < end) {
        c0 = crc_u64(c0, load_u64(p));
        c1 = crc_u64(c1, load_u64(p + block));
        c2 = crc_u64(c2, load_u64(p + 2 * block));
        p += 8;
    }
    c0 = shift(s, c0) ^ c1;
    return shift(s, c0) ^ c2;
}

HPCCKPT_CRC_TARGET std::uint32_t hw_raw(std::uint32_t c, const unsigned char* p, std::size_t n) {
    using hpcckpt::arch::crc_u64;
    using hpcckpt::arch::crc_u8;
    while (n != 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
        c = crc_u8(c, *p++);
        --n;
    }
    if (n >= 3 * kLong) {
        const ShiftTable& s = shift_long();
        while (n >= 3 * kLong) {
            c = hw_three_way(c, p, kLong, s);
            p += 3 * kLong;
            n -= 3 * kLong;
        }
    }
    if (n >= 3 * kShort) {
        const ShiftTable& s = shift_short();
        while (n >= 3 * kShort) {
            c = hw_three_way(c, p, kShort, s);
            p += 3 * kShort;
            n -= 3 * kShort;
        }
    }
    while (n >= 8) {
        c = crc_u64(c, hpcckpt::arch::load_u64(p));
        p += 8;
        n -= 8;
    }
    while (n-- != 0) c = crc_u8(c, *p++);
    return c;
}
#endif

using RawFn = std::uint32_t (*)(std::uint32_t, const unsigned char*, std::size_t);

struct Dispatch {
    RawFn fn;
    const char* name;
};

Dispatch choose() {
    // HPCCKPT_CRC32C_IMPL=software forces the portable path (benchmarks, tests).
    const char* forced = std::getenv("HPCCKPT_CRC32C_IMPL");
    if (forced != nullptr && std::strcmp(forced, "software") == 0) return {sw_raw, "software"};
#if HPCCKPT_HAVE_CRC_HW
    if (hpcckpt::arch::detect().crc32c) {
        // Build the tables now so that the first timed call does not pay for them.
        (void)shift_long();
        (void)shift_short();
#if defined(__x86_64__)
        return {hw_raw, "sse4.2"};
#else
        return {hw_raw, "armv8-crc"};
#endif
    }
#endif
    return {sw_raw, "software"};
}

const Dispatch& dispatch() {
    static const Dispatch d = choose();
    return d;
}

// GF(2) polynomial arithmetic modulo the CRC polynomial (for combine).
std::uint32_t multmodp(std::uint32_t a, std::uint32_t b) {
    std::uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
    }
    return p;
}

std::array<std::uint32_t, 32> make_x2n() {
    std::array<std::uint32_t, 32> x{};
    std::uint32_t p = 1u << 30;  // x^1
    x[0] = p;
    for (std::size_t n = 1; n < 32; ++n) x[n] = p = multmodp(p, p);
    return x;
}

// x^(n * 2^k) mod P
std::uint32_t x2nmodp(std::uint64_t n, unsigned k) {
    static const std::array<std::uint32_t, 32> x2n = make_x2n();
    std::uint32_t p = 1u << 31;  // x^0
    while (n != 0) {
        if (n & 1u) p = multmodp(x2n[k & 31u], p);
        n >>= 1;
        ++k;
    }
    return p;
}

}  // namespace

extern "C" uint32_t hpcckpt_crc32c(uint32_t crc, const void* data, size_t len) {
    return ~dispatch().fn(~crc, static_cast<const unsigned char*>(data), len);
}

extern "C" uint32_t hpcckpt_crc32c_software(uint32_t crc, const void* data, size_t len) {
    return ~sw_raw(~crc, static_cast<const unsigned char*>(data), len);
}

extern "C" uint32_t hpcckpt_crc32c_hardware(uint32_t crc, const void* data, size_t len) {
#if HPCCKPT_HAVE_CRC_HW
    (void)dispatch();  // tables
    return ~hw_raw(~crc, static_cast<const unsigned char*>(data), len);
#else
    return hpcckpt_crc32c_software(crc, data, len);
#endif
}

extern "C" uint32_t hpcckpt_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

extern "C" const char* hpcckpt_crc32c_impl(void) { return dispatch().name; }
