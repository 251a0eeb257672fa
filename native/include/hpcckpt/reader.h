/* Parallel reads of one file into caller memory, checksummed on arrival.
 *
 * The load path of a checkpoint: every tensor of a rank file is one item
 * (destination, file offset, length). Items are cut into chunks that several
 * threads pread at once; each chunk is crc32c'd right after it lands, and the
 * chunk crcs are combined into the item's crc, so no second pass over the
 * bytes is needed to verify them. With `direct`, chunks whose destination and
 * file offset are 4 KiB-aligned bypass the page cache (O_DIRECT); the tail of
 * a chunk past its last full 4 KiB block, unaligned chunks, and files on file
 * systems that refuse O_DIRECT go through the page cache instead. A chunk whose
 * file offset is aligned but whose destination is not aligned as the file's
 * O_DIRECT needs (statx STATX_DIOALIGN; 4 KiB when the kernel does not say), e.g.
 * a live model's parameters on a disk wanting 512, is read with O_DIRECT into a small
 * aligned bounce buffer of the reading thread and copied over piece by piece,
 * checksummed while each piece is still in cache. */
#ifndef HPCCKPT_READER_H
#define HPCCKPT_READER_H

#include <stddef.h>
#include <stdint.h>

#include "hpcckpt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hpcckpt_read_item {
    void* dst;        /* in: len writable bytes */
    uint64_t offset;  /* in: file offset of the first byte */
    uint64_t len;     /* in */
    uint32_t crc;     /* out: crc32c of the bytes read (valid when the call returned 0) */
    uint32_t flags;   /* in: HPCCKPT_READ_* */
} hpcckpt_read_item;

/* The destination is memory never touched yet: with populate > 0 its pages are
 * faulted in ahead of the reads. Items without it (memory already in use, e.g.
 * a live model restored in place) are read first, while the populating threads
 * work on the fresh ones. */
#define HPCCKPT_READ_FRESH 1u

typedef struct hpcckpt_read_stats {
    uint64_t direct_bytes;    /* bytes that came through O_DIRECT */
    uint64_t buffered_bytes;  /* bytes that came through the page cache */
    unsigned threads;         /* threads that ran */
    uint64_t bounced_bytes;   /* of direct_bytes: those that went through a bounce buffer */
    uint64_t direct_mem_align; /* memory alignment O_DIRECT used (statx DIOALIGN, else 4096); 0: none */
} hpcckpt_read_stats;

/* Reads every item of `path`. threads == 0: chosen from the CPU count and the
 * amount of data; chunk_bytes is rounded up to 4 KiB (0: 16 MiB). Returns 0, or
 * -1 with st filled by the first failure (errno, op, path, offset). A file that
 * ends before an item does gives err ENODATA with op "pread (unexpected end of
 * file)". stats may be NULL.
 * populate > 0: that many more threads fault in the pages of HPCCKPT_READ_FRESH
 * items (MADV_POPULATE_WRITE, else a write per page), chunk by chunk in reading
 * order, and each such chunk is read once its pages are in: the page faults then
 * overlap the I/O of earlier chunks instead of sitting inside each read.
 * threads == 0: hpcckpt_usable_cpus() decides. */
int hpcckpt_read_items(const char* path, hpcckpt_read_item* items, size_t n, unsigned threads,
                       size_t chunk_bytes, int direct, unsigned populate, hpcckpt_read_stats* stats,
                       hpcckpt_status* st);

/* The same through a descriptor the caller opened and checked (it stays open): the file
 * is never looked up by name, so a symlink or FIFO swapped in under its name is never
 * read. `path` only names it in errors. Refuses (EINVAL) anything but a regular file;
 * O_DIRECT reads use a second descriptor reopened through /proc/self/fd/<fd>. The
 * path form opens with O_NOFOLLOW|O_NONBLOCK and calls this. */
int hpcckpt_read_items_fd(int fd, const char* path, hpcckpt_read_item* items, size_t n, unsigned threads,
                          size_t chunk_bytes, int direct, unsigned populate, hpcckpt_read_stats* stats,
                          hpcckpt_status* st);

/* The crc32c of each byte range [offsets[i], offsets[i] + lens[i]) of the open regular file
 * `fd` into crcs[i] (0 for an empty range): the verify path, where a rank file may hold
 * tens of thousands of small tensors. Ranges are taken in file order and gathered into
 * spans of at most chunk_bytes (0: 8 MiB; gaps under 1 MiB are read through), each span
 * is read once (O_DIRECT with `direct` where the file system allows, else through the
 * page cache; direct == 2: O_DIRECT only for spans mostly not in the page cache, as a
 * verify finds a file that a prefetch has partly read) into its thread's buffer and every range in it is checksummed from there;
 * a range longer than a chunk is read in pieces whose crcs are combined. Memory:
 * threads x chunk_bytes, whatever the file's size. threads == 0: from the usable CPUs
 * (4..8). whole_len != 0: also the crc32c of the file's first whole_len bytes into *whole_crc,
 * in the same pass (each byte read once: the file is read in chunk-sized blocks, each
 * checksummed whole and for every range inside it; a verify checks both the whole file and
 * its tensors). Returns 0, or -1 with st filled (ENODATA: the file ends before a range, or
 * whole_len, does). stats may be NULL. */
int hpcckpt_checksum_ranges_fd(int fd, const char* path, const uint64_t* offsets, const uint64_t* lens,
                               uint32_t* crcs, size_t n, uint64_t whole_len, uint32_t* whole_crc, unsigned threads,
                               size_t chunk_bytes, int direct, hpcckpt_read_stats* stats, hpcckpt_status* st);

/* How many bytes of `path` are in the page cache now (mincore over a
 * read-only mapping); *size gets the file size. Lets a loader skip O_DIRECT
 * when the file is already cached (a restart on the node that wrote it).
 * Returns 0, or -1 with st filled. */
int hpcckpt_file_resident(const char* path, uint64_t* resident, uint64_t* size, hpcckpt_status* st);
/* The same through the caller's descriptor (left open); a non-regular file is EINVAL. */
int hpcckpt_file_resident_fd(int fd, const char* path, uint64_t* resident, uint64_t* size, hpcckpt_status* st);

#ifdef __cplusplus
}
#endif
#endif
