// The only file that knows about Python: converts buffers, releases the GIL
// around every blocking call, and turns core status codes into exceptions.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "hpcckpt/crc32c.h"
#include "hpcckpt/io.h"
#include "hpcckpt/memory.h"
#include "hpcckpt/persist.h"
#include "hpcckpt/reader.h"
#include "hpcckpt/writer.h"

namespace nb = nanobind;

namespace {

// RAII view of an object exporting the buffer protocol (contiguous bytes).
class Buffer {
public:
    Buffer(nb::handle obj, bool writable) {
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw nb::python_error();
        held_ = true;
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { release(); }
    void release() {
        if (held_) PyBuffer_Release(&view_);
        held_ = false;
    }
    void* data() const { return view_.buf; }
    size_t size() const { return static_cast<size_t>(view_.len); }

private:
    Py_buffer view_{};
    bool held_ = false;
};

[[noreturn]] void raise_os_error(int err, const std::string& text, const std::string& path) {
    nb::object exc = path.empty()
                         ? nb::steal(PyObject_CallFunction(PyExc_OSError, "is", err, text.c_str()))
                         : nb::steal(PyObject_CallFunction(PyExc_OSError, "iss", err, text.c_str(),
                                                           path.c_str()));
    if (!exc.is_valid()) throw nb::python_error();
    PyErr_SetObject(PyExc_OSError, exc.ptr());
    throw nb::python_error();
}

std::string describe(const hpcckpt_status& st) {
    std::string s = std::string(st.op) + " '" + st.path + "'";
    if (st.offset >= 0) s += " at offset " + std::to_string(st.offset);
    return s + ": " + std::strerror(st.err);
}

int64_t timeout_ns(const nb::object& timeout) {
    if (timeout.is_none()) return -1;
    double s = nb::cast<double>(timeout);
    if (!(s >= 0.0)) throw nb::value_error("timeout must be None or >= 0 seconds");
    if (s > 1e9) return -1;
    return static_cast<int64_t>(std::llround(s * 1e9));
}

uint32_t py_crc32c(nb::handle data, uint32_t crc) {
    Buffer b(data, false);
    nb::gil_scoped_release nogil;
    return hpcckpt_crc32c(crc, b.data(), b.size());
}

uint32_t py_crc32c_software(nb::handle data, uint32_t crc) {
    Buffer b(data, false);
    nb::gil_scoped_release nogil;
    return hpcckpt_crc32c_software(crc, b.data(), b.size());
}

void py_parallel_copy(nb::handle dst, nb::handle src, unsigned threads) {
    Buffer d(dst, true);
    Buffer s(src, false);
    if (d.size() != s.size())
        throw nb::value_error(("parallel_copy: dst has " + std::to_string(d.size()) +
                               " bytes but src has " + std::to_string(s.size()))
                                  .c_str());
    nb::gil_scoped_release nogil;
    hpcckpt_parallel_copy(d.data(), s.data(), d.size(), threads);
}

void py_persist_range(nb::handle buf) {
    Buffer b(buf, false);
    nb::gil_scoped_release nogil;
    hpcckpt_persist_range(b.data(), b.size());
}

void py_fdatasync(int fd, const std::string& path) {
    hpcckpt_status st;
    hpcckpt_status_clear(&st);
    int rc = 0;
    {
        nb::gil_scoped_release nogil;
        rc = hpcckpt_fdatasync(fd, path.c_str(), &st);
    }
    if (rc != 0) raise_os_error(st.err, std::strerror(st.err), path);
}


// read_items(path, [(dst, offset[, fresh]), ...]) -> ([crc, ...], {stats}); dst: writable buffers.
std::tuple<std::vector<uint32_t>, nb::dict> py_read_items(const std::string& path, nb::list items,
                                                           unsigned threads, size_t chunk_bytes, bool direct,
                                                           unsigned populate, int fd) {
    std::vector<std::unique_ptr<Buffer>> held;
    std::vector<hpcckpt_read_item> raw;
    held.reserve(items.size());
    raw.reserve(items.size());
    for (nb::handle h : items) {
        nb::tuple t = nb::cast<nb::tuple>(h);
        if (t.size() != 2 && t.size() != 3)
            throw nb::value_error("read_items: each item must be (writable buffer, file offset[, fresh])");
        held.push_back(std::make_unique<Buffer>(t[0], true));
        const bool fresh = t.size() == 3 && nb::cast<bool>(t[2]);
        raw.push_back(hpcckpt_read_item{held.back()->data(), nb::cast<uint64_t>(t[1]), held.back()->size(), 0,
                                        fresh ? HPCCKPT_READ_FRESH : 0u});
    }
    hpcckpt_status st;
    hpcckpt_read_stats stats{};
    int rc = 0;
    {
        nb::gil_scoped_release nogil;
        rc = fd >= 0 ? hpcckpt_read_items_fd(fd, path.c_str(), raw.data(), raw.size(), threads, chunk_bytes,
                                             direct ? 1 : 0, populate, &stats, &st)
                     : hpcckpt_read_items(path.c_str(), raw.data(), raw.size(), threads, chunk_bytes,
                                          direct ? 1 : 0, populate, &stats, &st);
    }
    if (rc != 0) raise_os_error(st.err, describe(st), st.path);
    std::vector<uint32_t> crcs;
    crcs.reserve(raw.size());
    for (const auto& r : raw) crcs.push_back(r.crc);
    nb::dict d;
    d["direct_bytes"] = stats.direct_bytes;
    d["buffered_bytes"] = stats.buffered_bytes;
    d["threads"] = stats.threads;
    d["bounced_bytes"] = stats.bounced_bytes;
    d["direct_mem_align"] = stats.direct_mem_align;
    return {crcs, d};
}

// checksum_ranges(fd, offsets, lengths) -> (bytes of uint32 crcs, {stats}); offsets and
// lengths: buffers of native uint64 (NumPy uint64 arrays), one entry per range. whole_len > 0:
// stats["whole_crc32c"] is the crc32c of the file's first whole_len bytes, from the same reads.
std::tuple<nb::bytes, nb::dict> py_checksum_ranges(int fd, nb::handle offsets, nb::handle lengths,
                                                   const std::string& path, unsigned threads, size_t chunk_bytes,
                                                   int direct, uint64_t whole_len) {
    Buffer offs(offsets, false), lens(lengths, false);
    if (offs.size() != lens.size() || offs.size() % sizeof(uint64_t) != 0)
        throw nb::value_error("checksum_ranges: offsets and lengths must be uint64 arrays of the same length");
    const size_t n = offs.size() / sizeof(uint64_t);
    std::vector<uint32_t> crcs(n);
    uint32_t whole = 0;
    hpcckpt_status st;
    hpcckpt_read_stats stats{};
    int rc = 0;
    {
        nb::gil_scoped_release nogil;
        rc = hpcckpt_checksum_ranges_fd(fd, path.c_str(), static_cast<const uint64_t*>(offs.data()),
                                        static_cast<const uint64_t*>(lens.data()), crcs.data(), n, whole_len,
                                        &whole, threads, chunk_bytes, direct, &stats, &st);
    }
    if (rc != 0) raise_os_error(st.err, describe(st), st.path);
    nb::dict d;
    d["direct_bytes"] = stats.direct_bytes;
    d["buffered_bytes"] = stats.buffered_bytes;
    d["threads"] = stats.threads;
    if (whole_len != 0) d["whole_crc32c"] = whole;
    return {nb::bytes(reinterpret_cast<const char*>(crcs.data()), n * sizeof(uint32_t)), d};
}

// ---- A manifest's tensor table (hpcckpt.store.tensortable), checked in one pass.

// A plain int (not bool, not a subclass) in 0..hi, as *out; false for anything else.
bool whole_u64(PyObject* o, uint64_t hi, uint64_t* out) {
    if (!PyLong_CheckExact(o)) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0 || v < 0) return false;  // -1 with an error cannot happen for an exact int
    if (static_cast<uint64_t>(v) > hi) return false;
    *out = static_cast<uint64_t>(v);
    return true;
}

// Bytes per element of a row's dtype, from the itemsize dict; rows mostly share a dtype, so
// a lookup is made once per run of them.
class RowItemsize {
public:
    explicit RowItemsize(nb::handle itemsize) : dict_(itemsize.ptr()) {
        if (!PyDict_Check(dict_)) throw nb::type_error("table_check: itemsize must be a dict");
    }
    // False: not an exact str, or not in the dict as a whole number.
    bool of(PyObject* dtype, uint64_t* size) {
        if (!PyUnicode_CheckExact(dtype)) return false;
        if (last_ == nullptr || (dtype != last_ && PyUnicode_Compare(dtype, last_) != 0)) {
            PyObject* got = PyDict_GetItemWithError(dict_, dtype);  // borrowed
            if (got == nullptr) {
                if (PyErr_Occurred()) throw nb::python_error();
                return false;
            }
            if (!whole_u64(got, UINT64_MAX, &size_)) return false;
            last_ = dtype;
        }
        *size = size_;
        return true;
    }

private:
    PyObject* dict_;
    PyObject* last_ = nullptr;
    uint64_t size_ = 0;
};

// A row's elements times its itemsize are its nbytes, at most file_bytes, and (offset not
// null) its offset is within off_t and its bytes end inside the file (an empty tensor's
// offset is not read); overflow anywhere fails it.
bool row_fits(uint64_t elems, uint64_t size, uint64_t nbytes, const uint64_t* offset, uint64_t file_bytes) {
    uint64_t bytes = 0, end = 0;
    if (nbytes > file_bytes || __builtin_mul_overflow(elems, size, &bytes) || bytes != nbytes) return false;
    if (offset == nullptr) return true;
    return *offset <= INT64_MAX &&
           (nbytes == 0 || (!__builtin_add_overflow(*offset, nbytes, &end) && end <= file_bytes));
}

// table_check(dtypes, shapes, nbytes, crcs, offsets, itemsize, file_bytes, max_dims) ->
// (offsets, nbytes, crcs) as bytes of native uint64, uint64, uint32, or None. None says only
// that some row needs a closer look (the caller checks row by row): a column not a list of the
// table's length, a dtype not in itemsize, a shape not a list of at most max_dims plain ints >= 0
// whose product times the itemsize is nbytes (any overflow counts), nbytes or a crc not a plain
// int in 0..file_bytes / 0..2^32-1, or (offsets not None) an offset not a plain int >= 0 whose
// range ends past file_bytes (an empty tensor's offset is not read). offsets None: zeros.
nb::object py_table_check(nb::handle dtypes, nb::handle shapes, nb::handle nbytes, nb::handle crcs,
                          nb::handle offsets, nb::handle itemsize, uint64_t file_bytes, size_t max_dims) {
    PyObject* dt = dtypes.ptr();
    PyObject* sh = shapes.ptr();
    PyObject* nbs = nbytes.ptr();
    PyObject* cr = crcs.ptr();
    PyObject* of = offsets.is_none() ? nullptr : offsets.ptr();
    RowItemsize sizes(itemsize);
    if (!PyList_CheckExact(dt) || !PyList_CheckExact(sh) || !PyList_CheckExact(nbs) || !PyList_CheckExact(cr) ||
        (of != nullptr && !PyList_CheckExact(of)))
        return nb::none();
    const Py_ssize_t n = PyList_GET_SIZE(dt);
    if (PyList_GET_SIZE(sh) != n || PyList_GET_SIZE(nbs) != n || PyList_GET_SIZE(cr) != n ||
        (of != nullptr && PyList_GET_SIZE(of) != n))
        return nb::none();
    std::vector<uint64_t> out_off(static_cast<size_t>(n), 0), out_nb(static_cast<size_t>(n));
    std::vector<uint32_t> out_crc(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        uint64_t size = 0;
        if (!sizes.of(PyList_GET_ITEM(dt, i), &size)) return nb::none();
        PyObject* s = PyList_GET_ITEM(sh, i);
        if (!PyList_CheckExact(s) || static_cast<size_t>(PyList_GET_SIZE(s)) > max_dims) return nb::none();
        uint64_t elems = 1;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(s); ++k) {
            uint64_t dim = 0;
            if (!whole_u64(PyList_GET_ITEM(s, k), INT64_MAX, &dim) || __builtin_mul_overflow(elems, dim, &elems))
                return nb::none();
        }
        uint64_t nb_i = 0, crc = 0, off = 0;
        if (!whole_u64(PyList_GET_ITEM(nbs, i), UINT64_MAX, &nb_i) ||
            !whole_u64(PyList_GET_ITEM(cr, i), UINT32_MAX, &crc) ||
            (of != nullptr && !whole_u64(PyList_GET_ITEM(of, i), UINT64_MAX, &off)) ||
            !row_fits(elems, size, nb_i, of != nullptr ? &off : nullptr, file_bytes))
            return nb::none();
        out_off[static_cast<size_t>(i)] = off;
        out_nb[static_cast<size_t>(i)] = nb_i;
        out_crc[static_cast<size_t>(i)] = static_cast<uint32_t>(crc);
    }
    const auto as_bytes = [](const auto& v) {
        return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0]));
    };
    return nb::make_tuple(as_bytes(out_off), as_bytes(out_nb), as_bytes(out_crc));
}

// table_check_packed(dtypes, ndim, dims, nbytes, crcs, offsets, itemsize, file_bytes, max_dims)
// -> bool: table_check for a table whose whole numbers are packed (hpcckpt/4): ndim uint16, dims,
// nbytes and offsets uint64, crcs uint32, native buffers of the table's length (dims: the sum of
// ndim), offsets None when the table has none. False says only that some row needs a closer look.
bool py_table_check_packed(nb::handle dtypes, nb::handle ndim, nb::handle dims, nb::handle nbytes,
                           nb::handle crcs, nb::handle offsets, nb::handle itemsize, uint64_t file_bytes,
                           size_t max_dims) {
    PyObject* dt = dtypes.ptr();
    RowItemsize sizes(itemsize);
    if (!PyList_CheckExact(dt)) return false;
    const size_t n = static_cast<size_t>(PyList_GET_SIZE(dt));
    Buffer nd(ndim, false), dm(dims, false), nbs(nbytes, false), cr(crcs, false);
    std::unique_ptr<Buffer> of;
    if (!offsets.is_none()) of = std::make_unique<Buffer>(offsets, false);
    if (nd.size() != n * sizeof(uint16_t) || nbs.size() != n * sizeof(uint64_t) || cr.size() != n * sizeof(uint32_t) ||
        dm.size() % sizeof(uint64_t) != 0 || (of && of->size() != n * sizeof(uint64_t)))
        return false;
    const auto* nd_p = static_cast<const uint16_t*>(nd.data());
    const auto* dm_p = static_cast<const uint64_t*>(dm.data());
    const auto* nb_p = static_cast<const uint64_t*>(nbs.data());
    const uint64_t* of_p = of ? static_cast<const uint64_t*>(of->data()) : nullptr;
    const size_t n_dims = dm.size() / sizeof(uint64_t);
    size_t at = 0;  // the next row's first dim
    for (size_t i = 0; i < n; ++i) {
        uint64_t size = 0;
        if (!sizes.of(PyList_GET_ITEM(dt, static_cast<Py_ssize_t>(i)), &size)) return false;
        if (nd_p[i] > max_dims || nd_p[i] > n_dims - at) return false;
        uint64_t elems = 1;
        for (size_t k = 0; k < nd_p[i]; ++k) {
            const uint64_t dim = dm_p[at + k];
            if (dim > INT64_MAX || __builtin_mul_overflow(elems, dim, &elems)) return false;
        }
        at += nd_p[i];
        if (!row_fits(elems, size, nb_p[i], of_p != nullptr ? &of_p[i] : nullptr, file_bytes)) return false;
    }
    return at == n_dims;  // crcs: 32 bits by their type
}

// ---- StagingBuffer: aligned, prefaulted memory exporting a writable buffer.

struct StagingBuffer {
    void* ptr = nullptr;
    size_t nbytes = 0;
    size_t alignment = 0;
    StagingBuffer() = default;
    StagingBuffer(const StagingBuffer&) = delete;
    StagingBuffer& operator=(const StagingBuffer&) = delete;
    ~StagingBuffer() { hpcckpt_aligned_free(ptr); }
};

int staging_getbuffer(PyObject* self, Py_buffer* view, int flags) {
    StagingBuffer* s = nb::inst_ptr<StagingBuffer>(self);
    return PyBuffer_FillInfo(view, self, s->ptr, static_cast<Py_ssize_t>(s->nbytes), 0, flags);
}

void staging_releasebuffer(PyObject*, Py_buffer*) {}

PyType_Slot staging_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(staging_getbuffer)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(staging_releasebuffer)},
    {0, nullptr}};

StagingBuffer* make_staging(size_t nbytes, size_t alignment, bool prefault, nb::object huge) {
    // huge: default to prefault (memory prefaulted is memory meant to be reused)
    const bool want_huge = huge.is_none() ? prefault : nb::cast<bool>(huge);
    const unsigned flags = (prefault ? HPCCKPT_ALLOC_PREFAULT : 0u) | (want_huge ? HPCCKPT_ALLOC_HUGE : 0u);
    hpcckpt_status st;
    void* p = nullptr;
    {
        nb::gil_scoped_release nogil;
        p = hpcckpt_aligned_alloc(nbytes, alignment, flags, &st);
    }
    if (p == nullptr) {
        if (st.err == EINVAL)
            throw nb::value_error(("aligned_buffer: alignment " + std::to_string(alignment) +
                                   " must be a power of two >= " + std::to_string(sizeof(void*)))
                                      .c_str());
        raise_os_error(st.err, "aligned_buffer(" + std::to_string(nbytes) + " bytes): " +
                                   std::strerror(st.err), "");
    }
    auto* s = new StagingBuffer();
    s->ptr = p;
    s->nbytes = nbytes;
    s->alignment = alignment;
    return s;
}

// ---- WriterPool / Batch

struct WriterPool {
    hpcckpt_pool* pool = nullptr;
    bool closed = false;
    WriterPool(const WriterPool&) = delete;
    WriterPool& operator=(const WriterPool&) = delete;
    WriterPool(unsigned threads, size_t chunk_bytes) {
        hpcckpt_status st;
        pool = hpcckpt_pool_create(threads, chunk_bytes, &st);
        if (pool == nullptr) {
            if (st.err == EINVAL) throw nb::value_error("WriterPool: chunk_bytes must be > 0");
            raise_os_error(st.err, std::string("WriterPool: ") + std::strerror(st.err), "");
        }
    }
    // Batches hold a reference to this object, so the core pool outlives them
    // even after close(): close only stops the threads.
    ~WriterPool() {
        nb::gil_scoped_release nogil;
        hpcckpt_pool_destroy(pool);
    }
    void close() {
        if (closed) return;
        closed = true;
        nb::gil_scoped_release nogil;
        hpcckpt_pool_close(pool);
    }
    hpcckpt_pool* get() const {
        if (closed) throw std::runtime_error("WriterPool is closed; create a new one");
        return pool;
    }
};

struct Batch {
    nb::object pool_ref;  // keeps the WriterPool alive while work may be queued
    hpcckpt_batch* batch = nullptr;
    std::vector<std::unique_ptr<Buffer>> held;  // released once the workers are done
    bool finished = false;
    bool raised = false;

    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    Batch(nb::object pool_obj, bool direct) : pool_ref(std::move(pool_obj)) {
        WriterPool& p = nb::cast<WriterPool&>(pool_ref);
        batch = hpcckpt_batch_create(p.get(), direct ? 1 : 0);
    }
    ~Batch() {
        {
            // Workers never touch Python, so waiting here without the GIL is safe.
            nb::gil_scoped_release nogil;
            hpcckpt_batch_destroy(batch);
        }
        held.clear();
    }

    int64_t add(const std::string& path, uint64_t offset, nb::handle data, nb::object src) {
        bool copy = !src.is_none();
        auto d = std::make_unique<Buffer>(data, copy);
        std::unique_ptr<Buffer> s;
        if (copy) {
            s = std::make_unique<Buffer>(src, false);
            if (s->size() != d->size())
                throw nb::value_error(("Batch.add('" + path + "'): staging has " +
                                       std::to_string(d->size()) + " bytes but src has " +
                                       std::to_string(s->size()))
                                          .c_str());
        }
        hpcckpt_status st;
        int64_t id = hpcckpt_batch_add(batch, path.c_str(), offset, d->data(),
                                       s ? s->data() : nullptr, d->size(), &st);
        if (id < 0) throw std::runtime_error("Batch.add('" + path + "') after start(); use a new Batch");
        held.push_back(std::move(d));
        if (s) held.push_back(std::move(s));
        return id;
    }

    // Many items of one file in one call: item i writes lengths[i] bytes of `data` at
    // data_offsets[i] to file offset file_offsets[i]; with `sources` (addresses, one per
    // item, 0 for none) the writers first copy lengths[i] bytes from that address into
    // data (the caller keeps every source alive and unchanged until wait_copied()).
    // All index arrays are native uint64. Returns the first item's id; the others follow
    // in order (-1 when there are none).
    int64_t add_many(const std::string& path, nb::handle data, nb::handle file_offsets, nb::handle data_offsets,
                     nb::handle lengths, nb::object sources) {
        const bool copy = !sources.is_none();
        auto d = std::make_unique<Buffer>(data, copy);
        Buffer fo(file_offsets, false), dof(data_offsets, false), len(lengths, false);
        std::unique_ptr<Buffer> src;
        if (copy) src = std::make_unique<Buffer>(sources, false);
        const size_t bytes = fo.size();
        if (bytes % sizeof(uint64_t) != 0 || dof.size() != bytes || len.size() != bytes || (src && src->size() != bytes))
            throw nb::value_error(("Batch.add_many('" + path + "'): file_offsets, data_offsets, lengths (and "
                                   "sources) must be uint64 arrays of the same length").c_str());
        const size_t n = bytes / sizeof(uint64_t);
        const auto* F = static_cast<const uint64_t*>(fo.data());
        const auto* D = static_cast<const uint64_t*>(dof.data());
        const auto* L = static_cast<const uint64_t*>(len.data());
        const uint64_t* S = src ? static_cast<const uint64_t*>(src->data()) : nullptr;
        for (size_t i = 0; i < n; ++i) {
            if (D[i] > d->size() || L[i] > d->size() - D[i])
                throw nb::value_error(("Batch.add_many('" + path + "'): item " + std::to_string(i) + " (" +
                                       std::to_string(L[i]) + " bytes at " + std::to_string(D[i]) +
                                       ") lies outside the " + std::to_string(d->size()) + "-byte buffer")
                                          .c_str());
            if (S != nullptr && S[i] == 0 && L[i] != 0)
                throw nb::value_error(("Batch.add_many('" + path + "'): item " + std::to_string(i) +
                                       " has no source address").c_str());
        }
        auto* base = static_cast<unsigned char*>(d->data());
        int64_t first = -1;
        hpcckpt_status st;
        for (size_t i = 0; i < n; ++i) {
            const void* from = S != nullptr ? reinterpret_cast<const void*>(static_cast<uintptr_t>(S[i])) : nullptr;
            int64_t id = hpcckpt_batch_add(batch, path.c_str(), F[i], base + D[i], from, static_cast<size_t>(L[i]), &st);
            if (id < 0) throw std::runtime_error("Batch.add_many('" + path + "') after start(); use a new Batch");
            if (first < 0) first = id;
        }
        held.push_back(std::move(d));
        return first;
    }

    // The crcs of items [first, first + count) as native uint32 bytes (after wait()).
    nb::bytes crcs(int64_t first, int64_t count) const {
        if (first < 0 || count < 0 || static_cast<size_t>(first + count) > hpcckpt_batch_items(batch))
            throw nb::index_error(("Batch.crcs: no items " + std::to_string(first) + ".." +
                                   std::to_string(first + count)).c_str());
        if (!finished) throw std::runtime_error("Batch.crcs() before wait() returned True");
        std::vector<uint32_t> out(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = hpcckpt_batch_crc(batch, static_cast<size_t>(first + i));
        return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uint32_t));
    }

    void start() {
        hpcckpt_status st;
        int rc;
        {
            // Queueing the tasks touches no Python object: without the GIL, the finisher's
            // commit of the previous save runs meanwhile (the writers open the files).
            nb::gil_scoped_release nogil;
            rc = hpcckpt_batch_start(batch, &st);
        }
        if (rc != 0)
            throw std::runtime_error(std::string(st.op) + ": create a new Batch / WriterPool");
    }

    void require_started(const char* what) const {
        if (!hpcckpt_batch_started(batch))
            throw std::runtime_error(std::string("Batch.") + what + "() before start()");
    }

    bool wait_copied(nb::object timeout) {
        require_started("wait_copied");
        int64_t ns = timeout_ns(timeout);
        nb::gil_scoped_release nogil;
        return hpcckpt_batch_wait_copied(batch, ns) == 1;
    }

    bool wait(nb::object timeout) {
        require_started("wait");
        if (!finished) {
            int64_t ns = timeout_ns(timeout);
            int rc = 0;
            {
                nb::gil_scoped_release nogil;
                rc = hpcckpt_batch_wait(batch, ns);
            }
            if (rc == 0) return false;
            finished = true;
            held.clear();
        }
        size_t n = hpcckpt_batch_error_count(batch);
        if (n == 0 || raised) return true;
        raised = true;
        hpcckpt_status first;
        hpcckpt_batch_error(batch, 0, &first);
        std::string text = describe(first);
        if (n > 1) {
            text += " (" + std::to_string(n) + " errors in this batch:";
            for (size_t i = 0; i < n; ++i) {
                hpcckpt_status e;
                hpcckpt_batch_error(batch, i, &e);
                text += " [" + describe(e) + "]";
            }
            text += ")";
        }
        raise_os_error(first.err, text, first.path);
    }

    uint32_t crc(int64_t item) const {
        if (item < 0 || static_cast<size_t>(item) >= hpcckpt_batch_items(batch))
            throw nb::index_error(("Batch.crc: no item " + std::to_string(item)).c_str());
        if (!finished) throw std::runtime_error("Batch.crc() before wait() returned True");
        return hpcckpt_batch_crc(batch, static_cast<size_t>(item));
    }
};

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "hpcckpt's compiled persist core (crc32c, staging memory, writer pool, barriers, reader).";
    // Tensors restored from a checkpoint live in StagingBuffers; a program that still
    // holds them when the interpreter exits (the usual case for model and optimizer
    // state) would otherwise get nanobind's "leaked instances" report at every exit.
    nb::set_leak_warnings(false);

    m.def("crc32c", &py_crc32c, nb::arg("data"), nb::arg("crc") = 0,
          "CRC-32C of a bytes-like object, continuing from crc. Releases the GIL.");
    m.def("crc32c_software", &py_crc32c_software, nb::arg("data"), nb::arg("crc") = 0,
          "The portable CRC-32C implementation (for tests and benchmarks).");
    m.def("crc32c_combine", &hpcckpt_crc32c_combine, nb::arg("crc1"), nb::arg("crc2"),
          nb::arg("len2"), "crc32c(A + B) from crc32c(A), crc32c(B) and len(B).");
    m.def("crc32c_impl", [] { return std::string(hpcckpt_crc32c_impl()); });
    m.def("parallel_copy", &py_parallel_copy, nb::arg("dst"), nb::arg("src"),
          nb::arg("threads") = 0, "memcpy split across threads (0 = auto). Releases the GIL.");
    m.def("barrier_kind", [] { return std::string(hpcckpt_barrier_kind()); });
    m.def("cache_line_bytes", [] { return hpcckpt_cache_line_bytes(); });
    m.def("persist_range", &py_persist_range, nb::arg("buf"));
    m.def("store_fence", [] { hpcckpt_store_fence(); });
    m.def("read_items", &py_read_items, nb::arg("path"), nb::arg("items"), nb::arg("threads") = 0,
          nb::arg("chunk_bytes") = 0, nb::arg("direct") = false, nb::arg("populate") = 0, nb::arg("fd") = -1,
          "Read (writable buffer, file offset) items of one file in parallel; returns each item's\n"
          "crc32c and {direct_bytes, buffered_bytes, bounced_bytes, threads}. OSError carries errno\n"
          "and path (ENODATA: the file ends before an item does). fresh: the buffer is memory never\n"
          "touched; populate: that many more threads fault fresh pages in ahead of the reads.\n"
          "Items in use are read first; unaligned ones go through O_DIRECT via bounce buffers.\n"
          "fd >= 0: read through that open descriptor, never by name (path only names it in errors).");
    m.def("checksum_ranges", &py_checksum_ranges, nb::arg("fd"), nb::arg("offsets"), nb::arg("lengths"),
          nb::arg("path") = "", nb::arg("threads") = 0, nb::arg("chunk_bytes") = 0, nb::arg("direct") = 0,
          nb::arg("whole_len") = 0,
          "crc32c of each byte range (offsets[i], lengths[i]: uint64 arrays) of the open file fd, read\n"
          "in file order, coalesced into chunk_bytes spans (0 = 8 MiB) on threads threads (0 = auto);\n"
          "direct: 0 through the page cache, 1 O_DIRECT (where allowed), 2 O_DIRECT for the spans mostly\n"
          "not cached; returns (bytes of native uint32 crcs, {direct_bytes, buffered_bytes, threads}). whole_len > 0:\n"
          "also the crc32c of the file's first whole_len bytes (stats['whole_crc32c']), from the same\n"
          "reads. OSError carries errno and path (ENODATA: the file ends before a range or whole_len does).");
    m.def("table_check", &py_table_check, nb::arg("dtypes"), nb::arg("shapes"), nb::arg("nbytes"), nb::arg("crcs"),
          nb::arg("offsets").none(), nb::arg("itemsize"), nb::arg("file_bytes"), nb::arg("max_dims"),
          "A manifest's tensor table checked in one pass: (offsets, nbytes, crcs) as bytes of native\n"
          "uint64, uint64, uint32 when every row passes the quick checks, else None (check row by row).");
    m.def("table_check_packed", &py_table_check_packed, nb::arg("dtypes"), nb::arg("ndim"), nb::arg("dims"),
          nb::arg("nbytes"), nb::arg("crcs"), nb::arg("offsets").none(), nb::arg("itemsize"), nb::arg("file_bytes"),
          nb::arg("max_dims"),
          "table_check for a table whose whole numbers are packed (hpcckpt/4): ndim uint16, dims,\n"
          "nbytes and offsets uint64, crcs uint32 buffers; True when every row passes the quick checks.");
    m.def("usable_cpus", &hpcckpt_usable_cpus,
          "CPUs this process may run on (its affinity mask, e.g. a Slurm cpuset).");
    m.def("file_resident", [](const std::string& path, int fd) {
              uint64_t resident = 0, size = 0;
              hpcckpt_status st;
              int rc;
              {
                  nb::gil_scoped_release nogil;
                  rc = fd >= 0 ? hpcckpt_file_resident_fd(fd, path.c_str(), &resident, &size, &st)
                               : hpcckpt_file_resident(path.c_str(), &resident, &size, &st);
              }
              if (rc != 0) raise_os_error(st.err, describe(st), st.path);
              return std::make_tuple(resident, size);
          }, nb::arg("path"), nb::arg("fd") = -1,
          "(bytes of path in the page cache, file size); fd >= 0: of that open descriptor");
    m.def("fdatasync", &py_fdatasync, nb::arg("fd"), nb::arg("path") = "");

    nb::class_<StagingBuffer>(m, "StagingBuffer", nb::type_slots(staging_slots))
        .def_ro("nbytes", &StagingBuffer::nbytes)
        .def_ro("alignment", &StagingBuffer::alignment)
        .def_prop_ro("address", [](const StagingBuffer& s) {
            return reinterpret_cast<uintptr_t>(s.ptr);
        })
        .def("__len__", [](const StagingBuffer& s) { return s.nbytes; });
    m.def("aligned_buffer", &make_staging, nb::arg("nbytes"), nb::arg("alignment") = 4096,
          nb::arg("prefault") = true, nb::arg("huge") = nb::none(), nb::rv_policy::take_ownership,
          "Aligned memory exporting a writable buffer. prefault: touch every page now;\n"
          "huge (default: same as prefault): 2 MiB-aligned with MADV_HUGEPAGE for blocks >= 4 MiB.");

    nb::class_<WriterPool>(m, "WriterPool")
        .def(nb::init<unsigned, size_t>(), nb::arg("threads") = 0,
             nb::arg("chunk_bytes") = size_t{8} << 20)
        .def("close", &WriterPool::close)
        .def_prop_ro("threads", [](const WriterPool& p) { return hpcckpt_pool_threads(p.pool); })
        .def_prop_ro("chunk_bytes",
                     [](const WriterPool& p) { return hpcckpt_pool_chunk_bytes(p.pool); })
        .def_prop_ro("closed", [](const WriterPool& p) { return p.closed; })
        .def("__enter__", [](nb::object self) { return self; })
        .def("__exit__", [](WriterPool& p, nb::args) { p.close(); });

    nb::class_<Batch>(m, "Batch")
        .def(nb::init<nb::object, bool>(), nb::arg("pool"), nb::arg("direct") = false)
        .def("add", &Batch::add, nb::arg("path"), nb::arg("offset"), nb::arg("data"),
             nb::arg("src") = nb::none())
        .def("start", &Batch::start)
        .def("wait_copied", &Batch::wait_copied, nb::arg("timeout") = nb::none())
        .def("wait", &Batch::wait, nb::arg("timeout") = nb::none())
        .def("crc", &Batch::crc, nb::arg("item"))
        .def("add_many", &Batch::add_many, nb::arg("path"), nb::arg("data"), nb::arg("file_offsets"),
             nb::arg("data_offsets"), nb::arg("lengths"), nb::arg("sources") = nb::none())
        .def("crcs", &Batch::crcs, nb::arg("first"), nb::arg("count"))
        .def_prop_ro("bytes_total", [](const Batch& b) { return hpcckpt_batch_bytes_total(b.batch); })
        .def_prop_ro("bytes_copied", [](const Batch& b) { return hpcckpt_batch_bytes_copied(b.batch); })
        .def_prop_ro("bytes_written",
                     [](const Batch& b) { return hpcckpt_batch_bytes_written(b.batch); });
}
