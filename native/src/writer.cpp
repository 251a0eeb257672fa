#include "hpcckpt/writer.h"

#include "hpcckpt/memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "hpcckpt/crc32c.h"
#include "hpcckpt/io.h"

namespace {

constexpr std::size_t kDirectAlign = 4096;
// Copy and checksum in pieces that stay in L2, so crc32c reads hot lines.
constexpr std::size_t kFuseBytes = 256u << 10;

enum class Kind { copy, write, sync };

struct Task {
    hpcckpt_batch* batch;
    Kind kind;
    std::size_t index;  // item for copy/write, file for sync
    std::size_t chunk;
};

struct Item {
    std::size_t file;
    std::uint64_t offset;
    unsigned char* data;
    const unsigned char* src;
    std::size_t len;
    std::vector<std::uint32_t> chunk_crc;
};

struct File {
    std::string path;
    int fd = -1;
    int direct_fd = -1;
    std::atomic<std::size_t> chunks_left{0};
    // Opened by the first writer task that needs it (``ensure_open``), not by start(): the
    // opens cost the training thread ~0.2 ms a save beside a commit in the same directory.
    std::once_flag opened;
};

std::string describe_path(const char* p) { return p != nullptr ? std::string(p) : std::string(); }

}  // namespace

struct hpcckpt_pool {
    std::mutex m;
    std::condition_variable cv;
    std::deque<Task> copies;
    std::deque<Task> writes;
    std::vector<std::thread> threads;
    unsigned active_writers = 0;
    bool closing = false;
    bool closed = false;
    std::size_t chunk_bytes = 8u << 20;

    void push(const Task& t);
    void push_all(const std::vector<Task>& ts);
    void run();
    bool next(Task& t);
};

struct hpcckpt_batch {
    hpcckpt_pool* pool = nullptr;
    bool direct = false;
    std::vector<Item> items;
    std::vector<File> files;  // stable after start()
    std::map<std::string, std::size_t> file_index;

    std::mutex m;
    std::condition_variable cv;
    bool started = false;
    bool done = false;
    std::size_t copies_left = 0;
    std::size_t files_left = 0;
    std::vector<hpcckpt_status> errors;
    std::atomic<bool> stop{false};  // failed or cancelled: skip remaining work

    std::uint64_t bytes_total = 0;
    std::atomic<std::uint64_t> bytes_copied{0};
    std::atomic<std::uint64_t> bytes_written{0};

    std::size_t chunks_of(const Item& it) const {
        return (it.len + pool->chunk_bytes - 1) / pool->chunk_bytes;
    }
    void fail(const hpcckpt_status& st) {
        std::lock_guard<std::mutex> g(m);
        errors.push_back(st);
        stop.store(true);
    }
};

namespace {

void run_copy(hpcckpt_batch* b, std::size_t item, std::size_t chunk);
void run_write(hpcckpt_batch* b, std::size_t item, std::size_t chunk);
void run_sync(hpcckpt_batch* b, std::size_t file);
void ensure_open(hpcckpt_batch* b, File& f);

void execute(const Task& t) {
    switch (t.kind) {
        case Kind::copy: run_copy(t.batch, t.index, t.chunk); break;
        case Kind::write: run_write(t.batch, t.index, t.chunk); break;
        case Kind::sync: run_sync(t.batch, t.index); break;
    }
}

}  // namespace

void hpcckpt_pool::push(const Task& t) {
    {
        std::lock_guard<std::mutex> g(m);
        (t.kind == Kind::copy ? copies : writes).push_back(t);
    }
    cv.notify_one();
}

// A batch's tasks in one locked section and one wake-up of every thread (a futex call
// per task was most of start() for a small state saved at every step).
void hpcckpt_pool::push_all(const std::vector<Task>& ts) {
    if (ts.empty()) return;
    {
        std::lock_guard<std::mutex> g(m);
        for (const Task& t : ts) (t.kind == Kind::copy ? copies : writes).push_back(t);
    }
    if (ts.size() == 1)
        cv.notify_one();
    else
        cv.notify_all();
}

// Copies go first so that wait_copied() returns early and the trainer can
// resume, but one thread always drains writes when any are queued.
bool hpcckpt_pool::next(Task& t) {
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [&] { return closing || !copies.empty() || !writes.empty(); });
    if (copies.empty() && writes.empty()) return false;
    bool take_write = !writes.empty() && (active_writers == 0 || copies.empty());
    std::deque<Task>& q = take_write ? writes : copies;
    t = q.front();
    q.pop_front();
    if (take_write) ++active_writers;
    return true;
}

void hpcckpt_pool::run() {
    Task t{};
    while (next(t)) {
        execute(t);
        if (t.kind != Kind::copy) {
            std::lock_guard<std::mutex> g(m);
            --active_writers;
        }
    }
}

namespace {

void finish_copy(hpcckpt_batch* b, std::uint64_t nbytes) {
    b->bytes_copied.fetch_add(nbytes);
    std::lock_guard<std::mutex> g(b->m);
    if (--b->copies_left == 0) b->cv.notify_all();
}

void run_copy(hpcckpt_batch* b, std::size_t item, std::size_t chunk) {
    Item& it = b->items[item];
    const std::size_t begin = chunk * b->pool->chunk_bytes;
    const std::size_t len = std::min(b->pool->chunk_bytes, it.len - begin);
    if (!b->stop.load()) {
        std::uint32_t crc = 0;
        for (std::size_t off = 0; off < len; off += kFuseBytes) {
            const std::size_t n = std::min(kFuseBytes, len - off);
            std::memcpy(it.data + begin + off, it.src + begin + off, n);
            crc = hpcckpt_crc32c(crc, it.data + begin + off, n);
        }
        it.chunk_crc[chunk] = crc;
    }
    finish_copy(b, len);
    b->pool->push(Task{b, Kind::write, item, chunk});
}

int pwrite_split(const File& f, const unsigned char* p, std::size_t len, std::uint64_t off,
                 hpcckpt_status* st) {
    if (f.direct_fd < 0) return hpcckpt_pwrite_all(f.fd, p, len, off, f.path.c_str(), st);
    std::size_t head = static_cast<std::size_t>((kDirectAlign - off % kDirectAlign) % kDirectAlign);
    head = std::min(head, len);
    if ((reinterpret_cast<std::uintptr_t>(p + head) % kDirectAlign) != 0)
        return hpcckpt_pwrite_all(f.fd, p, len, off, f.path.c_str(), st);
    const std::size_t mid = (len - head) / kDirectAlign * kDirectAlign;
    const std::size_t tail = len - head - mid;
    if (head != 0 && hpcckpt_pwrite_all(f.fd, p, head, off, f.path.c_str(), st) != 0) return -1;
    if (mid != 0 &&
        hpcckpt_pwrite_all(f.direct_fd, p + head, mid, off + head, f.path.c_str(), st) != 0) {
        // Some file systems accept O_DIRECT at open but reject the transfer.
        if (st->err != EINVAL) return -1;
        hpcckpt_status_clear(st);
        if (hpcckpt_pwrite_all(f.fd, p + head, mid, off + head, f.path.c_str(), st) != 0) return -1;
    }
    if (tail != 0 &&
        hpcckpt_pwrite_all(f.fd, p + head + mid, tail, off + head + mid, f.path.c_str(), st) != 0)
        return -1;
    return 0;
}

void run_write(hpcckpt_batch* b, std::size_t item, std::size_t chunk) {
    Item& it = b->items[item];
    File& f = b->files[it.file];
    const std::size_t begin = chunk * b->pool->chunk_bytes;
    const std::size_t len = std::min(b->pool->chunk_bytes, it.len - begin);
    ensure_open(b, f);
    if (!b->stop.load()) {
        if (it.src == nullptr) it.chunk_crc[chunk] = hpcckpt_crc32c(0, it.data + begin, len);
        hpcckpt_status st;
        hpcckpt_status_clear(&st);
        if (pwrite_split(f, it.data + begin, len, it.offset + begin, &st) != 0)
            b->fail(st);
        else
            b->bytes_written.fetch_add(len);
    }
    if (f.chunks_left.fetch_sub(1) == 1) b->pool->push(Task{b, Kind::sync, it.file, 0});
}

void close_fd(int& fd, const std::string& path, hpcckpt_batch* b, bool report) {
    if (fd < 0) return;
    // close() is not retried on EINTR: on Linux the descriptor is gone either way.
    if (::close(fd) != 0 && report && errno != EINTR) {
        hpcckpt_status st;
        hpcckpt_status_set(&st, errno, "close", path.c_str(), -1);
        b->fail(st);
    }
    fd = -1;
}

void run_sync(hpcckpt_batch* b, std::size_t file) {
    File& f = b->files[file];
    ensure_open(b, f);  // a file with no chunks is still created
    if (!b->stop.load() && f.fd >= 0) {
        hpcckpt_status st;
        hpcckpt_status_clear(&st);
        if (hpcckpt_fdatasync(f.fd, f.path.c_str(), &st) != 0) b->fail(st);
    }
    close_fd(f.direct_fd, f.path, b, false);
    close_fd(f.fd, f.path, b, !b->stop.load());
    std::lock_guard<std::mutex> g(b->m);
    if (--b->files_left == 0) {
        b->done = true;
        b->cv.notify_all();
    }
}

// open(2) retried on EINTR: a signal (the very warning that triggers a final save) may
// interrupt an open on NFS/FUSE or one that waits for a lease; failing the save for it
// would lose the checkpoint that signal asked for.
int open_eintr(const char* path, int flags, mode_t mode = 0) {
    int fd;
    do {
        fd = ::open(path, flags, mode);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

void open_file(hpcckpt_batch* b, File& f) {
    f.fd = open_eintr(f.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (f.fd < 0) {
        hpcckpt_status st;
        hpcckpt_status_set(&st, errno, "open", f.path.c_str(), -1);
        b->fail(st);
        return;
    }
    if (b->direct) {
        // tmpfs and some FUSE mounts refuse O_DIRECT: fall back to the page cache.
        f.direct_fd = open_eintr(f.path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_DIRECT);
    }
}

void ensure_open(hpcckpt_batch* b, File& f) {
    std::call_once(f.opened, [b, &f] { open_file(b, f); });
}

template <class Pred>
int wait_for(hpcckpt_batch* b, int64_t timeout_ns, Pred pred) {
    std::unique_lock<std::mutex> g(b->m);
    if (timeout_ns < 0) {
        b->cv.wait(g, pred);
        return 1;
    }
    return b->cv.wait_for(g, std::chrono::nanoseconds(timeout_ns), pred) ? 1 : 0;
}

}  // namespace

extern "C" hpcckpt_pool* hpcckpt_pool_create(unsigned threads, size_t chunk_bytes,
                                             hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (chunk_bytes == 0) {
        hpcckpt_status_set(st, EINVAL, "WriterPool(chunk_bytes=0)", "", -1);
        return nullptr;
    }
    if (threads == 0) threads = std::clamp(hpcckpt_usable_cpus(), 2u, 16u);
    auto* p = new hpcckpt_pool();
    p->chunk_bytes = chunk_bytes;
    try {
        for (unsigned i = 0; i < threads; ++i) p->threads.emplace_back([p] { p->run(); });
    } catch (const std::system_error& e) {
        hpcckpt_pool_destroy(p);
        hpcckpt_status_set(st, e.code().value(), "pthread_create", "", -1);
        return nullptr;
    }
    return p;
}

extern "C" unsigned hpcckpt_pool_threads(const hpcckpt_pool* pool) {
    return static_cast<unsigned>(pool->threads.size());
}

extern "C" size_t hpcckpt_pool_chunk_bytes(const hpcckpt_pool* pool) { return pool->chunk_bytes; }

extern "C" void hpcckpt_pool_close(hpcckpt_pool* pool) {
    {
        std::lock_guard<std::mutex> g(pool->m);
        if (pool->closed) return;
        pool->closing = true;
    }
    pool->cv.notify_all();
    for (auto& t : pool->threads) t.join();
    std::lock_guard<std::mutex> g(pool->m);
    pool->closed = true;
}

extern "C" void hpcckpt_pool_destroy(hpcckpt_pool* pool) {
    if (pool == nullptr) return;
    hpcckpt_pool_close(pool);
    delete pool;
}

extern "C" hpcckpt_batch* hpcckpt_batch_create(hpcckpt_pool* pool, int direct) {
    auto* b = new hpcckpt_batch();
    b->pool = pool;
    b->direct = direct != 0;
    return b;
}

extern "C" int64_t hpcckpt_batch_add(hpcckpt_batch* b, const char* path, uint64_t offset,
                                     void* data, const void* src, size_t len, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (b->started) {
        hpcckpt_status_set(st, EINVAL, "Batch.add after start", path, static_cast<int64_t>(offset));
        return -1;
    }
    const std::string p = describe_path(path);
    auto found = b->file_index.find(p);
    std::size_t file = 0;
    if (found == b->file_index.end()) {
        file = b->file_index.size();
        b->file_index.emplace(p, file);
    } else {
        file = found->second;
    }
    Item it{file, offset, static_cast<unsigned char*>(data), static_cast<const unsigned char*>(src),
            len, {}};
    b->items.push_back(std::move(it));
    b->bytes_total += len;
    return static_cast<int64_t>(b->items.size() - 1);
}

extern "C" int hpcckpt_batch_start(hpcckpt_batch* b, hpcckpt_status* st) {
    hpcckpt_status_clear(st);
    if (b->started) {
        hpcckpt_status_set(st, EINVAL, "Batch.start called twice", "", -1);
        return -1;
    }
    {
        std::lock_guard<std::mutex> g(b->pool->m);
        if (b->pool->closing) {
            hpcckpt_status_set(st, EPIPE, "Batch.start on a closed WriterPool", "", -1);
            return -1;
        }
    }
    b->files = std::vector<File>(b->file_index.size());
    for (const auto& [path, index] : b->file_index) b->files[index].path = path;
    std::vector<Task> tasks;
    std::size_t copies = 0;
    for (std::size_t i = 0; i < b->items.size(); ++i) {
        Item& it = b->items[i];
        const std::size_t n = b->chunks_of(it);
        it.chunk_crc.assign(n, 0);
        b->files[it.file].chunks_left += n;
        for (std::size_t c = 0; c < n; ++c)
            tasks.push_back(Task{b, it.src != nullptr ? Kind::copy : Kind::write, i, c});
        if (it.src != nullptr) copies += n;
    }
    {
        std::lock_guard<std::mutex> g(b->m);
        b->started = true;
        b->copies_left = copies;
        b->files_left = b->files.size();
        b->done = b->files.empty();
    }
    for (std::size_t i = 0; i < b->files.size(); ++i)
        if (b->files[i].chunks_left.load() == 0) tasks.push_back(Task{b, Kind::sync, i, 0});
    b->pool->push_all(tasks);
    return 0;
}

extern "C" int hpcckpt_batch_started(const hpcckpt_batch* b) { return b->started ? 1 : 0; }

extern "C" int hpcckpt_batch_wait_copied(hpcckpt_batch* b, int64_t timeout_ns) {
    return wait_for(b, timeout_ns, [b] { return b->started && b->copies_left == 0; });
}

extern "C" int hpcckpt_batch_wait(hpcckpt_batch* b, int64_t timeout_ns) {
    return wait_for(b, timeout_ns, [b] { return b->done; });
}

extern "C" size_t hpcckpt_batch_error_count(hpcckpt_batch* b) {
    std::lock_guard<std::mutex> g(b->m);
    return b->errors.size();
}

extern "C" int hpcckpt_batch_error(hpcckpt_batch* b, size_t i, hpcckpt_status* out) {
    std::lock_guard<std::mutex> g(b->m);
    if (i >= b->errors.size()) return -1;
    *out = b->errors[i];
    return 0;
}

extern "C" size_t hpcckpt_batch_items(const hpcckpt_batch* b) { return b->items.size(); }

extern "C" uint32_t hpcckpt_batch_crc(const hpcckpt_batch* b, size_t item) {
    const Item& it = b->items.at(item);
    std::uint32_t crc = 0;
    for (std::size_t c = 0; c < it.chunk_crc.size(); ++c) {
        const std::size_t len = std::min(b->pool->chunk_bytes, it.len - c * b->pool->chunk_bytes);
        crc = hpcckpt_crc32c_combine(crc, it.chunk_crc[c], len);
    }
    return crc;
}

extern "C" uint64_t hpcckpt_batch_bytes_total(const hpcckpt_batch* b) { return b->bytes_total; }
extern "C" uint64_t hpcckpt_batch_bytes_copied(const hpcckpt_batch* b) { return b->bytes_copied.load(); }
extern "C" uint64_t hpcckpt_batch_bytes_written(const hpcckpt_batch* b) { return b->bytes_written.load(); }

extern "C" void hpcckpt_batch_destroy(hpcckpt_batch* b) {
    if (b == nullptr) return;
    if (b->started) {
        b->stop.store(true);
        hpcckpt_batch_wait(b, -1);
    }
    delete b;
}
