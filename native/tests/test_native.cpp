// Standalone tests of the core (no Python). Exit status 0 = all passed.
// Usage: hpcckpt_native_tests [scratch-dir]   (default: $TMPDIR or /tmp)
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "hpcckpt/crc32c.h"
#include "hpcckpt/io.h"
#include "hpcckpt/memory.h"
#include "hpcckpt/persist.h"
#include "hpcckpt/reader.h"
#include "hpcckpt/writer.h"

namespace {

int g_failures = 0;
int g_checks = 0;
std::string g_dir;

#define CHECK(cond)                                                              \
    do {                                                                         \
        ++g_checks;                                                              \
        if (!(cond)) {                                                           \
            ++g_failures;                                                        \
            std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                        \
    } while (0)

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<unsigned char> v(n);
    for (auto& c : v) c = static_cast<unsigned char>(rng() & 0xffu);
    return v;
}

std::vector<unsigned char> read_file(const std::string& path) {
    std::vector<unsigned char> out;
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return out;
    unsigned char buf[65536];
    for (;;) {
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n <= 0) break;
        out.insert(out.end(), buf, buf + n);
    }
    ::close(fd);
    return out;
}

std::string scratch(const char* name) {
    std::string p = g_dir + "/" + name;
    ::unlink(p.c_str());
    return p;
}

void test_crc_vectors() {
    const char* s = "123456789";
    CHECK(hpcckpt_crc32c(0, s, 9) == 0xE3069283u);
    CHECK(hpcckpt_crc32c_software(0, s, 9) == 0xE3069283u);
    CHECK(hpcckpt_crc32c(0, s, 0) == 0u);
    CHECK(hpcckpt_crc32c(0, nullptr, 0) == 0u);
    // RFC 3720 (iSCSI) B.4 vectors.
    unsigned char buf[32];
    std::memset(buf, 0, 32);
    CHECK(hpcckpt_crc32c(0, buf, 32) == 0x8A9136AAu);
    std::memset(buf, 0xff, 32);
    CHECK(hpcckpt_crc32c(0, buf, 32) == 0x62A8AB43u);
    for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
    CHECK(hpcckpt_crc32c(0, buf, 32) == 0x46DD794Eu);
    for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
    CHECK(hpcckpt_crc32c(0, buf, 32) == 0x113FDB5Cu);
}

void test_crc_hw_matches_software() {
    auto data = random_bytes((3u << 20) + 77, 1);
    int mismatches = 0;
    for (std::size_t start = 0; start < 9; ++start)
        for (std::size_t len = 0; len <= 1000; ++len)
            if (hpcckpt_crc32c(0, data.data() + start, len) !=
                hpcckpt_crc32c_software(0, data.data() + start, len))
                ++mismatches;
    CHECK(mismatches == 0);
    const std::size_t larges[] = {767, 768, 769, 24575, 24576, 24577, 100000, (1u << 20) + 5,
                                  data.size() - 3};
    for (std::size_t len : larges) {
        CHECK(hpcckpt_crc32c(0, data.data() + 3, len) ==
              hpcckpt_crc32c_software(0, data.data() + 3, len));
        CHECK(hpcckpt_crc32c_hardware(0, data.data() + 1, len) ==
              hpcckpt_crc32c_software(0, data.data() + 1, len));
    }
    // Chaining: crc(b, crc(a)) == crc(a + b).
    const std::uint32_t whole = hpcckpt_crc32c(0, data.data(), data.size());
    const std::uint32_t a = hpcckpt_crc32c(0, data.data(), 123457);
    CHECK(hpcckpt_crc32c(a, data.data() + 123457, data.size() - 123457) == whole);
}

void test_crc_combine() {
    auto data = random_bytes(200000, 2);
    const std::uint32_t whole = hpcckpt_crc32c(0, data.data(), data.size());
    const std::size_t splits[] = {0, 1, 7, 4096, 99999, 199999, 200000};
    for (std::size_t k : splits) {
        std::uint32_t a = hpcckpt_crc32c(0, data.data(), k);
        std::uint32_t b = hpcckpt_crc32c(0, data.data() + k, data.size() - k);
        CHECK(hpcckpt_crc32c_combine(a, b, data.size() - k) == whole);
    }
}

void test_barrier_and_persist() {
    const char* kind = hpcckpt_barrier_kind();
    const std::string k = kind;
    CHECK(k == "clwb" || k == "clflushopt" || k == "clflush" || k == "dc cvap" ||
          k == "dc cvac" || k == "none");
    CHECK(hpcckpt_cache_line_bytes() >= 16);
    std::string path = scratch("persist.bin");
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    const std::size_t n = 1u << 20;
    CHECK(::ftruncate(fd, static_cast<off_t>(n)) == 0);
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(m != MAP_FAILED);
    if (m == MAP_FAILED) return;
    auto src = random_bytes(n, 3);
    std::memcpy(m, src.data(), n);
    // Unaligned start and length on purpose: every overlapping line must be flushed.
    hpcckpt_persist_range(static_cast<unsigned char*>(m) + 3, n - 10);
    hpcckpt_store_fence();
    CHECK(::msync(m, n, MS_SYNC) == 0);
    ::munmap(m, n);
    ::close(fd);
    CHECK(read_file(path) == src);
    ::unlink(path.c_str());
}

void test_memory() {
    hpcckpt_status st;
    void* p = hpcckpt_aligned_alloc((5u << 20) + 3, 4096, 1, &st);
    CHECK(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
    CHECK(hpcckpt_aligned_alloc(10, 3, 0, &st) == nullptr && st.err == EINVAL);
    auto src = random_bytes((5u << 20) + 3, 4);
    for (unsigned threads : {0u, 1u, 2u, 3u, 7u}) {
        std::memset(p, 0, src.size());
        hpcckpt_parallel_copy(p, src.data(), src.size(), threads);
        CHECK(std::memcmp(p, src.data(), src.size()) == 0);
    }
    hpcckpt_aligned_free(p);
}

void test_io_errors() {
    hpcckpt_status st;
    hpcckpt_status_clear(&st);
    unsigned char b[16] = {};
    CHECK(hpcckpt_pwrite_all(-1, b, sizeof b, 0, "/nowhere/file", &st) == -1);
    CHECK(st.err == EBADF && std::string(st.path) == "/nowhere/file" && st.offset == 0);
    hpcckpt_status_clear(&st);
    CHECK(hpcckpt_fdatasync(-1, "/nowhere/other", &st) == -1);
    CHECK(st.err == EBADF && std::string(st.path) == "/nowhere/other");
}

struct Written {
    std::string path;
    std::uint64_t offset;
    std::vector<unsigned char> bytes;
};

bool wait_ok(hpcckpt_batch* b) { return hpcckpt_batch_wait(b, -1) == 1 && hpcckpt_batch_error_count(b) == 0; }

void test_writer_roundtrip(bool direct) {
    hpcckpt_status st;
    hpcckpt_pool* pool = hpcckpt_pool_create(3, 64u << 10, &st);
    CHECK(pool != nullptr);
    std::string f1 = scratch(direct ? "w1d.bin" : "w1.bin");
    std::string f2 = scratch(direct ? "w2d.bin" : "w2.bin");
    // Items: aligned, unaligned offset, zero length, and one copied from a source.
    const std::size_t n1 = (3u << 20) + 4096, n2 = 1000003, n3 = (2u << 20) + 17;
    void* staging = hpcckpt_aligned_alloc(n1, 4096, 1, &st);
    auto src1 = random_bytes(n1, 5);
    auto d2 = random_bytes(n2, 6);
    auto d3 = random_bytes(n3, 7);
    hpcckpt_batch* b = hpcckpt_batch_create(pool, direct ? 1 : 0);
    int64_t i1 = hpcckpt_batch_add(b, f1.c_str(), 0, staging, src1.data(), n1, &st);
    int64_t i2 = hpcckpt_batch_add(b, f1.c_str(), n1 + 5, d2.data(), nullptr, n2, &st);
    int64_t i3 = hpcckpt_batch_add(b, f2.c_str(), 4096, d3.data(), nullptr, n3, &st);
    int64_t i4 = hpcckpt_batch_add(b, f2.c_str(), 0, d3.data(), nullptr, 0, &st);
    CHECK(i1 == 0 && i2 == 1 && i3 == 2 && i4 == 3);
    CHECK(hpcckpt_batch_bytes_total(b) == n1 + n2 + n3);
    CHECK(hpcckpt_batch_start(b, &st) == 0);
    CHECK(hpcckpt_batch_add(b, f1.c_str(), 0, staging, nullptr, 1, &st) == -1);
    CHECK(hpcckpt_batch_wait_copied(b, -1) == 1);
    CHECK(hpcckpt_batch_bytes_copied(b) == n1);
    CHECK(wait_ok(b));
    CHECK(hpcckpt_batch_bytes_written(b) == n1 + n2 + n3);
    CHECK(hpcckpt_batch_crc(b, 0) == hpcckpt_crc32c(0, src1.data(), n1));
    CHECK(hpcckpt_batch_crc(b, 1) == hpcckpt_crc32c(0, d2.data(), n2));
    CHECK(hpcckpt_batch_crc(b, 2) == hpcckpt_crc32c(0, d3.data(), n3));
    CHECK(hpcckpt_batch_crc(b, 3) == 0u);
    auto r1 = read_file(f1);
    auto r2 = read_file(f2);
    CHECK(r1.size() == n1 + 5 + n2);
    CHECK(r2.size() == 4096 + n3);
    if (r1.size() == n1 + 5 + n2) {
        CHECK(std::memcmp(r1.data(), src1.data(), n1) == 0);
        CHECK(std::memcmp(r1.data() + n1 + 5, d2.data(), n2) == 0);
    }
    if (r2.size() == 4096 + n3) CHECK(std::memcmp(r2.data() + 4096, d3.data(), n3) == 0);
    hpcckpt_batch_destroy(b);
    hpcckpt_aligned_free(staging);
    hpcckpt_pool_destroy(pool);
    ::unlink(f1.c_str());
    ::unlink(f2.c_str());
}

void test_writer_errors_then_reuse() {
    hpcckpt_status st;
    hpcckpt_pool* pool = hpcckpt_pool_create(2, 1u << 16, &st);
    auto data = random_bytes(1u << 20, 8);
    // /dev/full answers every write with ENOSPC.
    hpcckpt_batch* b = hpcckpt_batch_create(pool, 0);
    hpcckpt_batch_add(b, "/dev/full", 0, data.data(), nullptr, data.size(), &st);
    std::string missing = g_dir + "/no-such-dir/x.bin";
    hpcckpt_batch_add(b, missing.c_str(), 0, data.data(), nullptr, 100, &st);
    CHECK(hpcckpt_batch_start(b, &st) == 0);
    CHECK(hpcckpt_batch_wait(b, -1) == 1);
    const std::size_t n = hpcckpt_batch_error_count(b);
    CHECK(n >= 1);
    bool saw_enospc = false, saw_enoent = false;
    for (std::size_t i = 0; i < n; ++i) {
        hpcckpt_status e;
        CHECK(hpcckpt_batch_error(b, i, &e) == 0);
        if (e.err == ENOSPC && std::string(e.path) == "/dev/full") saw_enospc = true;
        if (e.err == ENOENT && std::string(e.path) == missing) saw_enoent = true;
    }
    hpcckpt_status e;
    CHECK(hpcckpt_batch_error(b, n, &e) == -1);
    // The open error is found in start(), before any write can hit /dev/full.
    CHECK(saw_enoent);
    (void)saw_enospc;
    hpcckpt_batch_destroy(b);

    b = hpcckpt_batch_create(pool, 0);
    hpcckpt_batch_add(b, "/dev/full", 0, data.data(), nullptr, data.size(), &st);
    CHECK(hpcckpt_batch_start(b, &st) == 0);
    CHECK(hpcckpt_batch_wait(b, -1) == 1);
    CHECK(hpcckpt_batch_error_count(b) >= 1);
    CHECK(hpcckpt_batch_error(b, 0, &e) == 0 && e.err == ENOSPC &&
          std::string(e.path) == "/dev/full" && std::string(e.op) == "pwrite");
    hpcckpt_batch_destroy(b);

    // The pool is still usable.
    std::string ok = scratch("after-error.bin");
    b = hpcckpt_batch_create(pool, 0);
    hpcckpt_batch_add(b, ok.c_str(), 0, data.data(), nullptr, data.size(), &st);
    CHECK(hpcckpt_batch_start(b, &st) == 0);
    CHECK(wait_ok(b));
    CHECK(read_file(ok) == data);
    hpcckpt_batch_destroy(b);
    hpcckpt_pool_destroy(pool);
    ::unlink(ok.c_str());
}

void test_batches_in_flight_and_commit_order() {
    hpcckpt_status st;
    hpcckpt_pool* pool = hpcckpt_pool_create(2, 1u << 18, &st);
    constexpr int kBatches = 5;
    std::vector<std::vector<unsigned char>> data;
    std::vector<std::string> paths;
    std::vector<hpcckpt_batch*> batches;
    for (int i = 0; i < kBatches; ++i) {
        data.push_back(random_bytes((1u << 20) + static_cast<std::size_t>(i) * 4099, 10u + static_cast<unsigned>(i)));
        paths.push_back(scratch(("flight" + std::to_string(i) + ".bin").c_str()));
        hpcckpt_batch* b = hpcckpt_batch_create(pool, i % 2);
        hpcckpt_batch_add(b, paths.back().c_str(), 0, data.back().data(), nullptr, data.back().size(), &st);
        batches.push_back(b);
    }
    for (auto* b : batches) CHECK(hpcckpt_batch_start(b, &st) == 0);
    // A batch dropped before wait() must cancel or finish without touching freed memory.
    {
        std::vector<unsigned char> doomed(4u << 20, 0x5a);
        std::string p = scratch("dropped.bin");
        hpcckpt_batch* b = hpcckpt_batch_create(pool, 0);
        hpcckpt_batch_add(b, p.c_str(), 0, doomed.data(), nullptr, doomed.size(), &st);
        hpcckpt_batch_start(b, &st);
        hpcckpt_batch_destroy(b);
        ::unlink(p.c_str());
    }
    // Commit record: written only after every data batch reported durable success.
    bool all_ok = true;
    for (auto* b : batches) all_ok = wait_ok(b) && all_ok;
    CHECK(all_ok);
    std::string manifest = scratch("commit.txt");
    std::string record;
    for (int i = 0; i < kBatches; ++i) {
        CHECK(hpcckpt_batch_crc(batches[static_cast<std::size_t>(i)], 0) ==
              hpcckpt_crc32c(0, data[static_cast<std::size_t>(i)].data(), data[static_cast<std::size_t>(i)].size()));
        record += paths[static_cast<std::size_t>(i)] + " " +
                  std::to_string(hpcckpt_batch_crc(batches[static_cast<std::size_t>(i)], 0)) + "\n";
    }
    hpcckpt_batch* commit = hpcckpt_batch_create(pool, 0);
    hpcckpt_batch_add(commit, manifest.c_str(), 0, record.data(), nullptr, record.size(), &st);
    CHECK(hpcckpt_batch_start(commit, &st) == 0);
    CHECK(wait_ok(commit));
    auto m = read_file(manifest);
    CHECK(std::string(m.begin(), m.end()) == record);
    for (int i = 0; i < kBatches; ++i) {
        auto r = read_file(paths[static_cast<std::size_t>(i)]);
        CHECK(r == data[static_cast<std::size_t>(i)]);
        CHECK(hpcckpt_crc32c(0, r.data(), r.size()) == hpcckpt_batch_crc(batches[static_cast<std::size_t>(i)], 0));
        ::unlink(paths[static_cast<std::size_t>(i)].c_str());
    }
    for (auto* b : batches) hpcckpt_batch_destroy(b);
    hpcckpt_batch_destroy(commit);
    // Start after close is refused, not queued forever.
    hpcckpt_pool_close(pool);
    hpcckpt_batch* late = hpcckpt_batch_create(pool, 0);
    CHECK(hpcckpt_batch_start(late, &st) == -1);
    hpcckpt_batch_destroy(late);
    hpcckpt_pool_destroy(pool);
    ::unlink(manifest.c_str());
}

}  // namespace

// Reads of aligned and unaligned items, with and without O_DIRECT, checksummed
// on arrival; a truncated file is reported as ENODATA, a missing one as ENOENT.
void test_reader(bool direct) {
    std::string path = scratch(direct ? "reader-direct.bin" : "reader.bin");
    const std::size_t size = (9u << 20) + 777;
    auto data = random_bytes(size, 7);
    int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    CHECK(fd >= 0);
    hpcckpt_status st;
    CHECK(hpcckpt_pwrite_all(fd, data.data(), data.size(), 0, path.c_str(), &st) == 0);
    ::close(fd);
    hpcckpt_status_clear(&st);
    // (offset, len): aligned body + odd tail, unaligned offset, tiny, empty, whole tail.
    const std::uint64_t spec[][2] = {{0, (5u << 20) + 100}, {4096 * 3 + 5, 70000}, {8192, 1}, {12288, 0},
                                     {(5u << 20) + 4096, size - (5u << 20) - 4096}, {4096, 1u << 20}};
    const std::size_t n = sizeof spec / sizeof spec[0];
    std::vector<void*> bufs(n);
    std::vector<unsigned char*> dsts(n);
    std::vector<hpcckpt_read_item> items(n);
    for (std::size_t i = 0; i < n; ++i) {
        // Item 0 lands 64 bytes past an aligned address (memory from a general allocator,
        // like a live model's parameters): O_DIRECT goes through a bounce buffer. Items 1
        // and 4 are fresh memory (faulted in by the populating threads).
        // Item 5 lands 512 bytes past: enough for O_DIRECT on a disk that asks for 512.
        const std::size_t shift = i == 0 ? 64 : (i == 5 ? 512 : 0);
        bufs[i] = hpcckpt_aligned_alloc(spec[i][1] + shift, 4096, shift != 0 ? HPCCKPT_ALLOC_PREFAULT : 0u, &st);
        CHECK(bufs[i] != nullptr);
        dsts[i] = static_cast<unsigned char*>(bufs[i]) + shift;
        items[i] = hpcckpt_read_item{dsts[i], spec[i][0], spec[i][1], 0xdeadbeef,
                                     (i == 1 || i == 4) ? HPCCKPT_READ_FRESH : 0u};
    }
    hpcckpt_read_stats stats;
    CHECK(hpcckpt_read_items(path.c_str(), items.data(), n, 3, 1u << 20, direct ? 1 : 0, direct ? 2u : 0u, &stats, &st) == 0);
    std::uint64_t want_bytes = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const unsigned char* src = data.data() + spec[i][0];
        CHECK(std::memcmp(dsts[i], src, spec[i][1]) == 0);
        CHECK(items[i].crc == hpcckpt_crc32c(0, src, spec[i][1]));
        want_bytes += spec[i][1];
    }
    CHECK(stats.direct_bytes + stats.buffered_bytes == want_bytes);
    CHECK(stats.threads >= 1 && stats.threads <= 3);
    CHECK(stats.bounced_bytes <= stats.direct_bytes);
    if (!direct) CHECK(stats.direct_bytes == 0 && stats.bounced_bytes == 0);
    // Where O_DIRECT works at all, item 0's aligned body (5 MiB) came through the bounce
    // buffers unless the file system takes memory aligned to 64 bytes (NVMe: 4), and
    // item 5's (1 MiB) unless it takes 512 (statx DIOALIGN; 4096 when not reported).
    if (direct && stats.direct_bytes != 0) {
        const std::uint64_t a = stats.direct_mem_align;
        CHECK(a >= 1 && a <= 4096);
        CHECK(stats.bounced_bytes == (a > 64 ? (5u << 20) : 0u) + (a > 512 ? (1u << 20) : 0u));
    }
    std::printf("reader(direct=%d): %llu bytes direct (memory alignment %llu, %llu bounced), %llu buffered\n",
                direct ? 1 : 0, static_cast<unsigned long long>(stats.direct_bytes),
                static_cast<unsigned long long>(stats.direct_mem_align),
                static_cast<unsigned long long>(stats.bounced_bytes),
                static_cast<unsigned long long>(stats.buffered_bytes));
    // Past the end of the file.
    hpcckpt_read_item past{bufs[0], size - 4096, 8192, 0, HPCCKPT_READ_FRESH};
    CHECK(hpcckpt_read_items(path.c_str(), &past, 1, 2, 0, direct ? 1 : 0, 1u, nullptr, &st) == -1);
    CHECK(st.err == ENODATA && std::string(st.path) == path && st.offset == static_cast<std::int64_t>(size));
    std::string missing = scratch("reader-missing.bin");
    CHECK(hpcckpt_read_items(missing.c_str(), items.data(), n, 2, 0, 0, 0u, nullptr, &st) == -1);
    CHECK(st.err == ENOENT && std::string(st.path) == missing);
    // Through an open descriptor: same bytes, the descriptor left open; never by name, so a
    // FIFO or a symlink put under the name is refused (never blocks, never followed).
    {
        int rfd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
        CHECK(rfd >= 0);
        hpcckpt_read_item one{bufs[0], 0, 4096, 0, 0};
        CHECK(hpcckpt_read_items_fd(rfd, "named-in-errors", &one, 1, 1, 0, direct ? 1 : 0, 0u, nullptr, &st) == 0);
        CHECK(one.crc == hpcckpt_crc32c(0, bufs[0], 4096) && ::fcntl(rfd, F_GETFD) >= 0);
        std::uint64_t res = 0, sz = 0;
        CHECK(hpcckpt_file_resident_fd(rfd, "x", &res, &sz, &st) == 0 && sz == size);
        ::close(rfd);
        std::string fifo = scratch("reader-fifo");
        CHECK(::mkfifo(fifo.c_str(), 0600) == 0);
        CHECK(hpcckpt_read_items(fifo.c_str(), &one, 1, 1, 0, 0, 0u, nullptr, &st) == -1 && st.err == EINVAL);
        CHECK(hpcckpt_file_resident(fifo.c_str(), &res, &sz, &st) == -1 && st.err == EINVAL);
        std::string link = scratch("reader-link");
        CHECK(::symlink(path.c_str(), link.c_str()) == 0);
        CHECK(hpcckpt_read_items(link.c_str(), &one, 1, 1, 0, 0, 0u, nullptr, &st) == -1 && st.err == ELOOP);
        ::unlink(fifo.c_str());
        ::unlink(link.c_str());
    }
    for (void* b : bufs) hpcckpt_aligned_free(b);
    // Residency: after fsync + DONTNEED nothing (or little) is cached; after a read, all of it.
    std::uint64_t resident = 0, fsize = 0;
    fd = ::open(path.c_str(), O_RDONLY);
    CHECK(fd >= 0 && ::fsync(fd) == 0);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    CHECK(hpcckpt_file_resident(path.c_str(), &resident, &fsize, &st) == 0);
    CHECK(fsize == size);
    std::uint64_t cold = resident;
    CHECK(read_file(path).size() == size);
    // Read pages may be evicted again at once when other processes press on memory (the test
    // suite runs beside this): held with mlock they must all be reported resident.
    fd = ::open(path.c_str(), O_RDONLY);
    void* map = fd >= 0 ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    const bool held = map != MAP_FAILED && ::mlock(map, size) == 0;
    CHECK(hpcckpt_file_resident(path.c_str(), &resident, &fsize, &st) == 0);
    CHECK(held ? resident == size && resident >= cold : resident <= size);
    if (map != MAP_FAILED) ::munmap(map, size);  // unlocks too
    if (fd >= 0) ::close(fd);
    CHECK(hpcckpt_file_resident(missing.c_str(), &resident, &fsize, &st) == -1 && st.err == ENOENT);
    ::unlink(path.c_str());
}

// Thread counts follow the affinity mask (a Slurm cpuset), not the node's CPU count.
void test_usable_cpus() {
    const unsigned all = hpcckpt_usable_cpus();
    CHECK(all >= 1);
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    CPU_ZERO(&set);
    CHECK(::sched_getaffinity(0, sizeof set, &set) == 0);
    CHECK(static_cast<int>(all) == CPU_COUNT(&set));
    int first = 0;
    while (first < CPU_SETSIZE && !CPU_ISSET(first, &set)) ++first;
    unsigned pinned = 0;
    std::thread t([&] {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(first, &one);
        if (::sched_setaffinity(0, sizeof one, &one) == 0) pinned = hpcckpt_usable_cpus();
    });
    t.join();
    CHECK(pinned == 1);
#endif
}

int main(int argc, char** argv) {
    const char* tmp = std::getenv("TMPDIR");
    g_dir = argc > 1 ? argv[1] : (tmp != nullptr ? tmp : "/tmp");
    std::printf("crc32c impl: %s\n", hpcckpt_crc32c_impl());
    std::printf("barrier: %s (cache line %zu bytes)\n", hpcckpt_barrier_kind(),
                hpcckpt_cache_line_bytes());
    test_crc_vectors();
    test_crc_hw_matches_software();
    test_crc_combine();
    test_barrier_and_persist();
    test_memory();
    test_usable_cpus();
    test_io_errors();
    test_writer_roundtrip(false);
    test_writer_roundtrip(true);
    test_writer_errors_then_reuse();
    test_batches_in_flight_and_commit_order();
    test_reader(false);
    test_reader(true);
    std::printf("%d checks, %d failed\n", g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
}
