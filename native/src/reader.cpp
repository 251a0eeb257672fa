#include "hpcckpt/reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "hpcckpt/crc32c.h"
#include "hpcckpt/memory.h"

namespace {

constexpr std::uint64_t kDirectAlign = 4096;
// 16 MiB chunks on 8+ threads keep enough requests in flight on a virtual disk while
// some threads checksum or copy (2-core VM, 2 GB cold: 0.84x -> 0.91x of a raw read).
constexpr std::size_t kDefaultChunk = 16u << 20;
// Bounce copies go piece by piece: checksum a piece, then copy it while it is still in cache.
constexpr std::uint64_t kBouncePiece = 256u << 10;

struct Chunk {
    std::size_t item;
    std::uint64_t start;  // within the item
    std::uint64_t len;
    std::uint32_t crc = 0;
};

bool aligned(std::uint64_t v) { return (v & (kDirectAlign - 1)) == 0; }

// The start of every read call on a caller's descriptor: status and stats cleared, the chunk
// size (0: `fallback`) rounded up to 4 KiB, and anything but a regular file refused (a FIFO
// or device would block or never end).
bool start_call(int fd, const char* path, std::size_t chunk_bytes, std::size_t fallback, std::uint64_t* chunk,
                hpcckpt_read_stats* stats, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (stats != nullptr) *stats = hpcckpt_read_stats{0, 0, 0, 0, 0};
    const std::uint64_t c = chunk_bytes == 0 ? fallback : chunk_bytes;
    *chunk = (c + kDirectAlign - 1) & ~(kDirectAlign - 1);
    struct stat sb;
    if (::fstat(fd, &sb) != 0) {
        hpcckpt_status_set(st, errno, "fstat", path, -1);
        return false;
    }
    if (!S_ISREG(sb.st_mode)) {
        hpcckpt_status_set(st, EINVAL, "open (not a regular file)", path, -1);
        return false;
    }
    return true;
}

// What the reading threads of one call share: the first failure (kept for the caller) and
// the pread loop that records it.
class ReadingThreads {
public:
    explicit ReadingThreads(const char* path) : path_(path) {}

    std::atomic<bool> failed{false};

    void first_error(hpcckpt_status* out) {
        std::lock_guard<std::mutex> g(m_);
        *out = status_;
    }

protected:
    void fail(int err, const char* op, std::uint64_t offset) {
        std::lock_guard<std::mutex> g(m_);
        if (!failed.exchange(true)) hpcckpt_status_set(&status_, err, op, path_, static_cast<std::int64_t>(offset));
    }

    // pread until `len` bytes arrived; returns the bytes read (short only at end of file), or
    // -1 (failed, recorded), or -2 (O_DIRECT refused here: this file system wants other alignment).
    std::int64_t pread_full(int fd, unsigned char* dst, std::uint64_t off, std::uint64_t len, bool direct) {
        std::uint64_t got = 0;
        while (got < len) {
            ssize_t r = ::pread(fd, dst + got, static_cast<std::size_t>(len - got), static_cast<off_t>(off + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                if (direct && errno == EINVAL && got == 0) return -2;
                fail(errno, direct ? "pread (O_DIRECT)" : "pread", off + got);
                return -1;
            }
            if (r == 0) break;
            got += static_cast<std::uint64_t>(r);
            // O_DIRECT reads of whole blocks stop early only at end of file.
            if (direct && !aligned(got)) break;
        }
        return static_cast<std::int64_t>(got);
    }

    const char* path_;

private:
    std::mutex m_;
    hpcckpt_status status_{};
};

class Reader : public ReadingThreads {
public:
    Reader(const char* path, hpcckpt_read_item* items, int fd, int direct_fd)
        : ReadingThreads(path), items_(items), fd_(fd), direct_fd_(direct_fd) {}

    std::vector<Chunk> chunks;  // items in use first, then fresh ones (fresh_begin..)
    std::size_t fresh_begin = 0;
    std::uint64_t chunk_bytes = kDefaultChunk;
    std::atomic<std::size_t> next{0};
    std::vector<char> ready;  // per chunk, when populating: its pages are in (guarded by pm_)
    std::atomic<std::size_t> pnext{0};
    bool populate = false;
    std::atomic<bool> direct_ok{true};
    std::atomic<std::uint64_t> direct_bytes{0};
    std::atomic<std::uint64_t> buffered_bytes{0};
    std::atomic<std::uint64_t> bounced_bytes{0};
    // Memory alignment O_DIRECT needs on this file (statx STATX_DIOALIGN where the kernel
    // reports it: 512 on a virtio disk, 4 on NVMe, where a general allocator's memory
    // qualifies and needs no bounce); 4 KiB when unknown.
    std::uint64_t mem_align = kDirectAlign;

    void run() {
        Bounce bounce;
        for (;;) {
            if (failed.load(std::memory_order_relaxed)) return;
            std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= chunks.size()) return;
            if (populate && i >= fresh_begin) wait_ready(i);
            Chunk& c = chunks[i];
            const hpcckpt_read_item& it = items_[c.item];
            auto* dst = static_cast<unsigned char*>(it.dst) + c.start;
            if (!read_chunk(dst, it.offset + c.start, c.len, &c.crc, bounce)) return;
        }
    }

    // A populating thread: fault in the destination pages of fresh chunks, in reading order.
    void populate_run() {
        const long pg = ::sysconf(_SC_PAGESIZE);
        const std::uintptr_t page = pg > 0 ? static_cast<std::uintptr_t>(pg) : 4096u;
        for (;;) {
            std::size_t i = pnext.fetch_add(1, std::memory_order_relaxed);
            if (i >= chunks.size()) return;
            if (!failed.load(std::memory_order_relaxed)) fault_in(chunks[i], page);
            {
                std::lock_guard<std::mutex> g(pm_);
                ready[i] = 1;
            }
            pcv_.notify_all();
        }
    }

private:
    // One reading thread's aligned buffer for O_DIRECT reads into unaligned destinations.
    struct Bounce {
        unsigned char* buf = nullptr;
        bool tried = false;
        Bounce() = default;
        Bounce(const Bounce&) = delete;
        Bounce& operator=(const Bounce&) = delete;
        ~Bounce() { hpcckpt_aligned_free(buf); }
        unsigned char* get(std::uint64_t size) {
            if (!tried) {
                tried = true;
                hpcckpt_status ignored;
                buf = static_cast<unsigned char*>(
                    hpcckpt_aligned_alloc(static_cast<std::size_t>(size), kDirectAlign, 0, &ignored));
            }
            return buf;  // nullptr: out of memory; the chunk goes through the page cache
        }
    };

    void wait_ready(std::size_t i) {
        std::unique_lock<std::mutex> g(pm_);
        pcv_.wait(g, [&] { return ready[i] != 0; });
    }

    // Only bytes inside the chunk are written (the read overwrites them); whole
    // pages inside it are populated by the kernel in one call where it can.
    void fault_in(const Chunk& c, std::uintptr_t page) {
        auto* dst = static_cast<unsigned char*>(items_[c.item].dst) + c.start;
        const auto lo = reinterpret_cast<std::uintptr_t>(dst);
        const auto hi = lo + static_cast<std::uintptr_t>(c.len);
        const std::uintptr_t a = (lo + page - 1) & ~(page - 1), b = hi & ~(page - 1);
        bool whole_pages_done = false;
#ifdef MADV_POPULATE_WRITE
        if (b > a && madvise_ok_.load(std::memory_order_relaxed)) {
            if (::madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE) == 0)
                whole_pages_done = true;
            else
                madvise_ok_.store(false, std::memory_order_relaxed);  // old kernel: touch instead
        }
#endif
        volatile unsigned char* v = dst;
        if (!whole_pages_done) {
            for (std::uintptr_t q = lo; q < hi; q = (q + page) & ~(page - 1)) v[q - lo] = 0;
        } else {
            if (lo < a) v[0] = 0;
            if (b < hi) v[b - lo] = 0;
        }
    }

    // Reads one chunk into dst and leaves its crc32c in *crc. The aligned body goes
    // through O_DIRECT when allowed (straight into dst, or via the thread's bounce
    // buffer when dst is not aligned), the rest through the page cache.
    bool read_chunk(unsigned char* dst, std::uint64_t off, std::uint64_t len, std::uint32_t* crc, Bounce& bounce) {
        std::uint64_t done = 0;
        std::uint32_t c = 0;
        std::uint64_t body = len & ~(kDirectAlign - 1);
        if (direct_fd_ >= 0 && body != 0 && direct_ok.load(std::memory_order_relaxed) && aligned(off)) {
            const bool dst_aligned = (reinterpret_cast<std::uintptr_t>(dst) & (mem_align - 1)) == 0;
            unsigned char* into = dst_aligned ? dst : bounce.get(chunk_bytes);
            if (into != nullptr) {
                std::int64_t r = pread_full(direct_fd_, into, off, body, true);
                if (r == -1) return false;
                if (r == -2) {
                    direct_ok.store(false, std::memory_order_relaxed);
                } else {
                    done = static_cast<std::uint64_t>(r);
                    direct_bytes.fetch_add(done, std::memory_order_relaxed);
                    if (dst_aligned) {
                        c = hpcckpt_crc32c(c, dst, static_cast<std::size_t>(done));
                    } else {
                        for (std::uint64_t p = 0; p < done; p += kBouncePiece) {
                            const auto k = static_cast<std::size_t>(std::min(kBouncePiece, done - p));
                            c = hpcckpt_crc32c(c, into + p, k);
                            std::memcpy(dst + p, into + p, k);
                        }
                        bounced_bytes.fetch_add(done, std::memory_order_relaxed);
                    }
                }
            }
        }
        if (done < len) {
            std::int64_t r = pread_full(fd_, dst + done, off + done, len - done, false);
            if (r < 0) return false;
            buffered_bytes.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
            c = hpcckpt_crc32c(c, dst + done, static_cast<std::size_t>(r));
            done += static_cast<std::uint64_t>(r);
        }
        if (done < len) {
            fail(ENODATA, "pread (unexpected end of file)", off + done);
            return false;
        }
        *crc = c;
        return true;
    }

    hpcckpt_read_item* items_;
    int fd_;
    int direct_fd_;
    std::mutex pm_;
    std::condition_variable pcv_;
    std::atomic<bool> madvise_ok_{true};
};

int open_retry(const char* path, int flags) {
    int fd;
    do {
        fd = ::open(path, flags | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

// A second descriptor of the open file `fd` with O_DIRECT: reopened through its
// /proc/self/fd entry, which names that very inode (no lookup of the file's name, so
// nothing swapped in under the name since it was opened is ever read). -1 when
// refused (tmpfs: EINVAL; no /proc): the reads then go through the page cache.
int reopen_direct(int fd) {
#ifdef O_DIRECT
    char proc[64];
    std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    return open_retry(proc, O_RDONLY | O_DIRECT);
#else
    (void)fd;
    return -1;
#endif
}

}  // namespace

extern "C" int hpcckpt_read_items(const char* path, hpcckpt_read_item* items, size_t n, unsigned threads,
                                  size_t chunk_bytes, int direct, unsigned populate,
                                  hpcckpt_read_stats* stats, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (stats != nullptr) *stats = hpcckpt_read_stats{0, 0, 0, 0, 0};
    int fd = open_retry(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        hpcckpt_status_set(st, errno, "open", path, -1);
        return -1;
    }
    int rc = hpcckpt_read_items_fd(fd, path, items, n, threads, chunk_bytes, direct, populate, stats, st);
    ::close(fd);
    return rc;
}

extern "C" int hpcckpt_read_items_fd(int fd, const char* path, hpcckpt_read_item* items, size_t n,
                                     unsigned threads, size_t chunk_bytes, int direct, unsigned populate,
                                     hpcckpt_read_stats* stats, hpcckpt_status* st) {
    std::uint64_t chunk = 0;
    if (!start_call(fd, path, chunk_bytes, kDefaultChunk, &chunk, stats, st)) return -1;
    const int direct_fd = direct != 0 ? reopen_direct(fd) : -1;
    Reader r(path, items, fd, direct_fd);
    r.chunk_bytes = chunk;
#if defined(STATX_DIOALIGN) && defined(AT_EMPTY_PATH)
    if (direct_fd >= 0) {
        struct statx sx {};
        if (::statx(direct_fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) != 0) {
            // Only a plausible answer relaxes the 4 KiB rule (qemu-user sets the mask and
            // leaves the fields 0); where O_DIRECT is refused, the first read says so (EINVAL).
            const std::uint32_t m = sx.stx_dio_mem_align, o = sx.stx_dio_offset_align;
            if (m != 0 && (m & (m - 1)) == 0 && m <= kDirectAlign && o != 0 && o <= kDirectAlign) r.mem_align = m;
        }
    }
#endif
    // Memory in use first: its reads keep the disk busy while the populating
    // threads fault in the fresh memory that comes after it.
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) r.fresh_begin = r.chunks.size();
        for (std::size_t i = 0; i < n; ++i) {
            const bool fresh = (items[i].flags & HPCCKPT_READ_FRESH) != 0;
            if (fresh != (pass == 1)) continue;
            items[i].crc = 0;
            for (std::uint64_t s = 0; s < items[i].len; s += chunk)
                r.chunks.push_back(Chunk{i, s, std::min<std::uint64_t>(chunk, items[i].len - s)});
        }
    }
    if (threads == 0) {
        // Enough requests in flight for the device while some threads checksum.
        threads = std::min<unsigned>(std::max(8u, 2 * hpcckpt_usable_cpus()), 16u);
    }
    threads = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, r.chunks.size())));
    std::vector<std::thread> pool;
    std::vector<std::thread> populaters;
    if (populate != 0 && r.fresh_begin < r.chunks.size()) {
        r.ready.assign(r.chunks.size(), 0);
        r.pnext.store(r.fresh_begin);
        r.populate = true;
        try {
            for (unsigned t = 0; t < populate; ++t) populaters.emplace_back([&r] { r.populate_run(); });
        } catch (const std::system_error&) {
            if (populaters.empty()) r.populate = false;  // the reads fault the pages in themselves
        }
    }
    try {
        for (unsigned t = 1; t < threads; ++t) pool.emplace_back([&r] { r.run(); });
    } catch (const std::system_error&) {
        // Fewer threads than asked is still correct; the caller's thread reads too.
    }
    r.run();
    for (auto& th : pool) th.join();
    for (auto& th : populaters) th.join();
    if (direct_fd >= 0) ::close(direct_fd);
    if (stats != nullptr)
        *stats = hpcckpt_read_stats{r.direct_bytes.load(), r.buffered_bytes.load(),
                                    static_cast<unsigned>(pool.size() + 1), r.bounced_bytes.load(),
                                    direct_fd >= 0 ? r.mem_align : 0};
    if (r.failed.load()) {
        r.first_error(st);
        return -1;
    }
    // Combine chunk crcs in order (the chunks of an item are consecutive, in order).
    for (const Chunk& c : r.chunks)
        items[c.item].crc = c.start == 0 ? c.crc : hpcckpt_crc32c_combine(items[c.item].crc, c.crc, c.len);
    return 0;
}

namespace {

// One byte per page of the file's first len bytes, bit 0 set where the page is in the page
// cache (mincore over a read-only mapping that touches nothing); errno-style code or 0.
int resident_pages(int fd, std::size_t len, std::size_t page, std::vector<unsigned char>* vec, const char** what) {
    vec->assign((len + page - 1) / page, 0);
    if (len == 0) return 0;
    void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        *what = "mmap";
        return errno;
    }
    int rc = ::mincore(m, len, vec->data());
    int err = errno;
    ::munmap(m, len);
    if (rc != 0) {
        *what = "mincore";
        return err;
    }
    return 0;
}

std::size_t page_bytes() {
    const long pg = ::sysconf(_SC_PAGESIZE);
    return pg > 0 ? static_cast<std::size_t>(pg) : 4096u;
}

}  // namespace

namespace {

// hpcckpt_checksum_ranges_fd: one piece of one range (a range longer than a chunk has several).
struct RangePiece {
    std::size_t range;
    std::uint64_t off;  // file offset
    std::uint64_t len;
    std::uint32_t crc = 0;
};

// Consecutive pieces (in file order) read with one pread: [lo, hi) of the file. A block of
// the whole-file checksum (``whole``) is also checksummed itself, into crc.
struct RangeSpan {
    std::uint64_t lo, hi;
    std::size_t first, last;  // pieces [first, last)
    bool whole = false;
    std::uint32_t crc = 0;
};

// Ranges closer than this are read through, gap included: one larger read beats two.
constexpr std::uint64_t kSpanGap = 1u << 20;
constexpr std::size_t kChecksumChunk = 8u << 20;

class RangeChecker : public ReadingThreads {
public:
    RangeChecker(const char* path, int fd, int direct_fd, std::uint64_t chunk)
        : ReadingThreads(path), fd_(fd), direct_fd_(direct_fd), chunk_(chunk) {}
    ~RangeChecker() {
        if (map_ != nullptr) ::munmap(map_, map_len_);
    }

    // O_DIRECT only for spans mostly not in the page cache, asked just before each is read
    // (a prefetch may still be finishing the pages ahead): through the cache otherwise. Where
    // residency cannot be asked (mapping refused), every span goes O_DIRECT as usual.
    void decide_by_residency() {
        struct stat sb;
        if (::fstat(fd_, &sb) != 0 || sb.st_size <= 0) return;
        void* m = ::mmap(nullptr, static_cast<std::size_t>(sb.st_size), PROT_READ, MAP_SHARED, fd_, 0);
        if (m == MAP_FAILED) return;
        map_ = m;
        map_len_ = static_cast<std::size_t>(sb.st_size);
        page_ = page_bytes();
    }

    std::vector<RangePiece> pieces;
    std::vector<RangeSpan> spans;
    std::atomic<std::size_t> next{0};
    std::atomic<std::uint64_t> direct_bytes{0};
    std::atomic<std::uint64_t> buffered_bytes{0};

    void run() {
        // The longest span plus the alignment slack of an O_DIRECT read on each side, touched
        // once and on huge pages where the kernel gives them: O_DIRECT into fresh 4 KiB pages
        // pins and faults each one and read at ~60% of the disk's rate on the development VM.
        std::uint64_t longest = 0;
        for (const RangeSpan& sp : spans) longest = std::max(longest, sp.hi - sp.lo);
        const std::uint64_t cap = std::min(chunk_, longest) + 2 * kDirectAlign;
        hpcckpt_status ignored;
        unsigned char* buf = static_cast<unsigned char*>(hpcckpt_aligned_alloc(
            static_cast<std::size_t>(cap), kDirectAlign, HPCCKPT_ALLOC_PREFAULT | HPCCKPT_ALLOC_HUGE, &ignored));
        if (buf == nullptr) {
            fail(ENOMEM, "checksum buffer", 0);
            return;
        }
        for (;;) {
            if (failed.load(std::memory_order_relaxed)) break;
            std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= spans.size()) break;
            RangeSpan& sp = spans[i];
            std::uint64_t base = 0;
            if (!read_span(buf, sp, &base)) break;
            if (sp.whole) sp.crc = hpcckpt_crc32c(0, buf + (sp.lo - base), static_cast<std::size_t>(sp.hi - sp.lo));
            for (std::size_t k = sp.first; k < sp.last; ++k) {
                RangePiece& p = pieces[k];
                p.crc = hpcckpt_crc32c(0, buf + (p.off - base), static_cast<std::size_t>(p.len));
            }
        }
        hpcckpt_aligned_free(buf);
    }

private:
    // The span's bytes into buf; *base: the file offset of buf[0].
    bool read_span(unsigned char* buf, const RangeSpan& sp, std::uint64_t* base) {
        if (direct_fd_ >= 0 && direct_ok_.load(std::memory_order_relaxed) && !cached(sp)) {
            const std::uint64_t lo = sp.lo & ~(kDirectAlign - 1);
            const std::uint64_t hi = (sp.hi + kDirectAlign - 1) & ~(kDirectAlign - 1);
            std::int64_t r = pread_full(direct_fd_, buf, lo, hi - lo, true);
            if (r == -1) return false;
            if (r >= 0) {
                *base = lo;
                direct_bytes.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
                if (lo + static_cast<std::uint64_t>(r) >= sp.hi) return true;
                fail(ENODATA, "pread (unexpected end of file)", lo + static_cast<std::uint64_t>(r));
                return false;
            }
            direct_ok_.store(false, std::memory_order_relaxed);
        }
        std::int64_t r = pread_full(fd_, buf, sp.lo, sp.hi - sp.lo, false);
        if (r < 0) return false;
        *base = sp.lo;
        buffered_bytes.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
        if (sp.lo + static_cast<std::uint64_t>(r) >= sp.hi) return true;
        fail(ENODATA, "pread (unexpected end of file)", sp.lo + static_cast<std::uint64_t>(r));
        return false;
    }

    // Whether most of the span's pages are in the page cache (only when deciding by residency).
    bool cached(const RangeSpan& sp) const {
        if (map_ == nullptr || sp.lo >= map_len_) return false;
        const std::size_t lo = static_cast<std::size_t>(sp.lo) / page_ * page_;
        const std::size_t hi = std::min<std::size_t>(map_len_, static_cast<std::size_t>(sp.hi));
        unsigned char vec[1024];  // asked a piece at a time: no allocation per span
        std::size_t pages = 0, in = 0;
        for (std::size_t at = lo; at < hi;) {
            const std::size_t len = std::min(hi - at, sizeof vec * page_);
            if (::mincore(static_cast<unsigned char*>(map_) + at, len, vec) != 0) return false;
            const std::size_t n = (len + page_ - 1) / page_;
            for (std::size_t k = 0; k < n; ++k) in += vec[k] & 1u;
            pages += n;
            at += len;
        }
        return pages != 0 && 2 * in >= pages;
    }

    int fd_;
    int direct_fd_;
    std::uint64_t chunk_;
    std::atomic<bool> direct_ok_{true};
    void* map_ = nullptr;
    std::size_t map_len_ = 0;
    std::size_t page_ = 4096;
};

}  // namespace


extern "C" int hpcckpt_checksum_ranges_fd(int fd, const char* path, const uint64_t* offsets, const uint64_t* lens,
                                          uint32_t* crcs, size_t n, uint64_t whole_len, uint32_t* whole_crc,
                                          unsigned threads, size_t chunk_bytes, int direct, hpcckpt_read_stats* stats,
                                          hpcckpt_status* st) {
    std::uint64_t chunk = 0;
    if (!start_call(fd, path, chunk_bytes, kChecksumChunk, &chunk, stats, st)) return -1;
    if (whole_len != 0 && whole_crc == nullptr) {
        hpcckpt_status_set(st, EINVAL, "checksum of the whole file (no place for its crc)", path, -1);
        return -1;
    }
    if (whole_crc != nullptr) *whole_crc = 0;
    for (std::size_t i = 0; i < n; ++i) {
        crcs[i] = 0;
        if (lens[i] > UINT64_MAX - offsets[i]) {
            hpcckpt_status_set(st, EINVAL, "checksum range (offset + length overflows)", path,
                               static_cast<std::int64_t>(offsets[i]));
            return -1;
        }
    }
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return offsets[a] < offsets[b]; });
    const int direct_fd = direct != 0 ? reopen_direct(fd) : -1;
    RangeChecker rc(path, fd, direct_fd, chunk);
    rc.pieces.reserve(n);
    // Pieces of at most a chunk; with the whole file, cut also where its blocks (chunk-sized,
    // from offset 0) are cut, so that each piece inside [0, whole_len) lies in one block.
    for (std::size_t i : order) {
        for (std::uint64_t s = 0; s < lens[i];) {
            const std::uint64_t off = offsets[i] + s;
            std::uint64_t len = std::min<std::uint64_t>(chunk, lens[i] - s);
            if (whole_len != 0 && off < whole_len) len = std::min<std::uint64_t>(len, chunk - off % chunk);
            rc.pieces.push_back(RangePiece{i, off, len});
            s += len;
        }
    }
    if (whole_len != 0) {
        // Each block is one span, checksummed whole and for every piece inside it; pieces that
        // reach past whole_len go after them, in spans of their own (below). Both stay in file
        // order, and so does each range's own pieces (what the combine below relies on).
        std::stable_sort(rc.pieces.begin(), rc.pieces.end(),
                         [](const RangePiece& a, const RangePiece& b) { return a.off < b.off; });
        auto inside = [whole_len](const RangePiece& p) { return p.off + p.len <= whole_len; };
        auto tail = std::stable_partition(rc.pieces.begin(), rc.pieces.end(), inside);
        const std::size_t n_inside = static_cast<std::size_t>(tail - rc.pieces.begin());
        std::size_t k = 0;
        for (std::uint64_t lo = 0; lo < whole_len; lo += chunk) {
            const std::uint64_t hi = std::min<std::uint64_t>(whole_len, lo + chunk);
            const std::size_t first = k;
            while (k < n_inside && rc.pieces[k].off < hi) ++k;
            RangeSpan sp{lo, hi, first, k};
            sp.whole = true;
            rc.spans.push_back(sp);
        }
    }
    // Spans: pieces in file order while the span stays within a chunk (alignment slack aside)
    // and the gap from the span's end is small. Overlapping ranges share the bytes read.
    const std::size_t blocks = rc.spans.size();
    std::size_t k0 = blocks == 0 ? 0 : rc.spans.back().last;
    for (std::size_t k = k0; k < rc.pieces.size(); ++k) {
        const RangePiece& p = rc.pieces[k];
        if (rc.spans.size() > blocks) {
            RangeSpan& sp = rc.spans.back();
            const std::uint64_t end = std::max(sp.hi, p.off + p.len);
            if (p.off >= sp.lo && p.off <= sp.hi + kSpanGap && end - sp.lo <= chunk) {
                sp.hi = end;
                sp.last = k + 1;
                continue;
            }
        }
        rc.spans.push_back(RangeSpan{p.off, p.off + p.len, k, k + 1});
    }
    if (direct == 2 && direct_fd >= 0) rc.decide_by_residency();
    if (threads == 0) threads = std::min<unsigned>(std::max(4u, 2 * hpcckpt_usable_cpus()), 8u);
    threads = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, rc.spans.size())));
    std::vector<std::thread> pool;
    try {
        for (unsigned t = 1; t < threads; ++t) pool.emplace_back([&rc] { rc.run(); });
    } catch (const std::system_error&) {
        // Fewer threads than asked is still correct; the caller's thread reads too.
    }
    rc.run();
    for (auto& th : pool) th.join();
    if (direct_fd >= 0) ::close(direct_fd);
    if (stats != nullptr)
        *stats = hpcckpt_read_stats{rc.direct_bytes.load(), rc.buffered_bytes.load(),
                                    static_cast<unsigned>(pool.size() + 1), 0, 0};
    if (rc.failed.load()) {
        rc.first_error(st);
        return -1;
    }
    // Each range's pieces come in its own order (consecutive unless the whole file interleaved
    // them): combine their crcs.
    std::vector<bool> seen(n, false);
    for (const RangePiece& p : rc.pieces) {
        crcs[p.range] = seen[p.range] ? hpcckpt_crc32c_combine(crcs[p.range], p.crc, p.len) : p.crc;
        seen[p.range] = true;
    }
    for (std::size_t b = 0; b < blocks; ++b) {
        const RangeSpan& sp = rc.spans[b];
        *whole_crc = b == 0 ? sp.crc : hpcckpt_crc32c_combine(*whole_crc, sp.crc, sp.hi - sp.lo);
    }
    return 0;
}

extern "C" int hpcckpt_file_resident(const char* path, uint64_t* resident, uint64_t* size, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    *resident = 0;
    *size = 0;
    int fd = open_retry(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        hpcckpt_status_set(st, errno, "open", path, -1);
        return -1;
    }
    int rc = hpcckpt_file_resident_fd(fd, path, resident, size, st);
    ::close(fd);
    return rc;
}

extern "C" int hpcckpt_file_resident_fd(int fd, const char* path, uint64_t* resident, uint64_t* size,
                                        hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    *resident = 0;
    *size = 0;
    struct stat sb;
    if (::fstat(fd, &sb) != 0) {
        hpcckpt_status_set(st, errno, "fstat", path, -1);
        return -1;
    }
    if (!S_ISREG(sb.st_mode)) {
        hpcckpt_status_set(st, EINVAL, "open (not a regular file)", path, -1);
        return -1;
    }
    *size = static_cast<uint64_t>(sb.st_size);
    if (sb.st_size == 0) return 0;
    const std::size_t page = page_bytes();
    std::vector<unsigned char> vec;
    const char* what = "";
    if (int err = resident_pages(fd, static_cast<std::size_t>(sb.st_size), page, &vec, &what); err != 0) {
        hpcckpt_status_set(st, err, what, path, -1);
        return -1;
    }
    uint64_t pages = 0;
    for (unsigned char v : vec) pages += v & 1u;
    *resident = std::min<uint64_t>(pages * page, *size);
    return 0;
}
