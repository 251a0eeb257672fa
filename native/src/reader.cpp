#include "hpcckpt/reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "hpcckpt/crc32c.h"

namespace {

constexpr std::uint64_t kDirectAlign = 4096;
constexpr std::size_t kDefaultChunk = 8u << 20;

struct Chunk {
    std::size_t item;
    std::uint64_t start;  // within the item
    std::uint64_t len;
    std::uint32_t crc = 0;
};

bool aligned(std::uint64_t v) { return (v & (kDirectAlign - 1)) == 0; }

class Reader {
public:
    Reader(const char* path, hpcckpt_read_item* items, int fd, int direct_fd)
        : path_(path), items_(items), fd_(fd), direct_fd_(direct_fd) {}

    std::vector<Chunk> chunks;
    std::atomic<std::size_t> next{0};
    std::vector<char> ready;  // per chunk, when populating: its pages are in (guarded by pm_)
    std::atomic<std::size_t> pnext{0};
    bool populate = false;
    std::atomic<bool> failed{false};
    std::atomic<bool> direct_ok{true};
    std::atomic<std::uint64_t> direct_bytes{0};
    std::atomic<std::uint64_t> buffered_bytes{0};

    void run() {
        for (;;) {
            if (failed.load(std::memory_order_relaxed)) return;
            std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= chunks.size()) return;
            if (populate) wait_ready(i);
            Chunk& c = chunks[i];
            const hpcckpt_read_item& it = items_[c.item];
            auto* dst = static_cast<unsigned char*>(it.dst) + c.start;
            if (!read_chunk(dst, it.offset + c.start, c.len)) return;
            c.crc = hpcckpt_crc32c(0, dst, static_cast<std::size_t>(c.len));
        }
    }

    // A populating thread: fault in the destination pages of chunks, in reading order.
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

    void first_error(hpcckpt_status* out) {
        std::lock_guard<std::mutex> g(m_);
        *out = status_;
    }

private:
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

    void fail(int err, const char* op, std::uint64_t offset) {
        std::lock_guard<std::mutex> g(m_);
        if (!failed.exchange(true)) hpcckpt_status_set(&status_, err, op, path_, static_cast<std::int64_t>(offset));
    }

    // pread until `len` bytes arrived; returns the bytes read (short only at EOF), or -1.
    std::int64_t pread_full(int fd, unsigned char* dst, std::uint64_t off, std::uint64_t len, bool direct) {
        std::uint64_t got = 0;
        while (got < len) {
            ssize_t r = ::pread(fd, dst + got, static_cast<std::size_t>(len - got), static_cast<off_t>(off + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                if (direct && errno == EINVAL && got == 0) return -2;  // this file system wants other alignment
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

    bool read_chunk(unsigned char* dst, std::uint64_t off, std::uint64_t len) {
        std::uint64_t done = 0;
        std::uint64_t body = len & ~(kDirectAlign - 1);
        if (direct_fd_ >= 0 && body != 0 && direct_ok.load(std::memory_order_relaxed) && aligned(off) &&
            aligned(reinterpret_cast<std::uintptr_t>(dst))) {
            std::int64_t r = pread_full(direct_fd_, dst, off, body, true);
            if (r == -1) return false;
            if (r == -2) {
                direct_ok.store(false, std::memory_order_relaxed);
            } else {
                done = static_cast<std::uint64_t>(r);
                direct_bytes.fetch_add(done, std::memory_order_relaxed);
            }
        }
        if (done < len) {
            std::int64_t r = pread_full(fd_, dst + done, off + done, len - done, false);
            if (r < 0) return false;
            buffered_bytes.fetch_add(static_cast<std::uint64_t>(r), std::memory_order_relaxed);
            done += static_cast<std::uint64_t>(r);
        }
        if (done < len) {
            fail(ENODATA, "pread (unexpected end of file)", off + done);
            return false;
        }
        return true;
    }

    const char* path_;
    hpcckpt_read_item* items_;
    int fd_;
    int direct_fd_;
    std::mutex m_;
    hpcckpt_status status_{};
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

}  // namespace

extern "C" int hpcckpt_read_items(const char* path, hpcckpt_read_item* items, size_t n, unsigned threads,
                                  size_t chunk_bytes, int direct, unsigned populate,
                                  hpcckpt_read_stats* stats, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (stats != nullptr) *stats = hpcckpt_read_stats{0, 0, 0};
    std::uint64_t chunk = chunk_bytes == 0 ? kDefaultChunk : chunk_bytes;
    chunk = (chunk + kDirectAlign - 1) & ~(kDirectAlign - 1);

    int fd = open_retry(path, O_RDONLY);
    if (fd < 0) {
        hpcckpt_status_set(st, errno, "open", path, -1);
        return -1;
    }
    int direct_fd = -1;
#ifdef O_DIRECT
    if (direct != 0) direct_fd = open_retry(path, O_RDONLY | O_DIRECT);  // refused (EINVAL) on tmpfs: fine
#else
    (void)direct;
#endif
    Reader r(path, items, fd, direct_fd);
    for (std::size_t i = 0; i < n; ++i) {
        items[i].crc = 0;
        for (std::uint64_t s = 0; s < items[i].len; s += chunk)
            r.chunks.push_back(Chunk{i, s, std::min<std::uint64_t>(chunk, items[i].len - s)});
    }
    if (threads == 0) {
        unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        // Two requests per core keep the device queue busy while one thread checksums.
        threads = std::min<unsigned>(std::max(2u, 2 * hw), 16u);
    }
    threads = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, r.chunks.size())));
    std::vector<std::thread> pool;
    std::vector<std::thread> populaters;
    if (populate != 0 && !r.chunks.empty()) {
        r.ready.assign(r.chunks.size(), 0);
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
    ::close(fd);
    if (stats != nullptr)
        *stats = hpcckpt_read_stats{r.direct_bytes.load(), r.buffered_bytes.load(),
                                    static_cast<unsigned>(pool.size() + 1)};
    if (r.failed.load()) {
        r.first_error(st);
        return -1;
    }
    // Combine chunk crcs in order (chunks of an item are consecutive).
    for (const Chunk& c : r.chunks)
        items[c.item].crc = c.start == 0 ? c.crc : hpcckpt_crc32c_combine(items[c.item].crc, c.crc, c.len);
    return 0;
}

extern "C" int hpcckpt_file_resident(const char* path, uint64_t* resident, uint64_t* size, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    *resident = 0;
    *size = 0;
    int fd = open_retry(path, O_RDONLY);
    if (fd < 0) {
        hpcckpt_status_set(st, errno, "open", path, -1);
        return -1;
    }
    struct stat sb;
    if (::fstat(fd, &sb) != 0) {
        hpcckpt_status_set(st, errno, "fstat", path, -1);
        ::close(fd);
        return -1;
    }
    *size = static_cast<uint64_t>(sb.st_size);
    if (sb.st_size == 0) {
        ::close(fd);
        return 0;
    }
    const long pg = ::sysconf(_SC_PAGESIZE);
    const std::size_t page = pg > 0 ? static_cast<std::size_t>(pg) : 4096u;
    const std::size_t len = static_cast<std::size_t>(sb.st_size);
    void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) {
        hpcckpt_status_set(st, errno, "mmap", path, -1);
        return -1;
    }
    std::vector<unsigned char> vec((len + page - 1) / page);
    int rc = ::mincore(m, len, vec.data());
    int err = errno;
    ::munmap(m, len);
    if (rc != 0) {
        hpcckpt_status_set(st, err, "mincore", path, -1);
        return -1;
    }
    uint64_t pages = 0;
    for (unsigned char v : vec) pages += v & 1u;
    *resident = std::min<uint64_t>(pages * page, *size);
    return 0;
}
