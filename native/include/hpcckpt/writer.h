/* A pool of persistent writer threads and batches of writes on it.
 *
 * Life of a batch (one checkpoint's writes):
 *   create -> add()* -> start() -> [wait_copied()] -> wait() -> crc()/errors -> destroy
 * start() opens each distinct path once (O_RDWR|O_CREAT, never truncated) and
 * queues the work; from then on everything runs on the pool's threads:
 *   per chunk: copy src -> staging (fused with crc32c)  -> pwrite
 *   per file, after its last chunk:                          fdatasync, close
 * Copies are preferred over writes except that one thread keeps writing, so
 * the write of chunk k overlaps the copy of chunk k+1. Several batches may be
 * in flight on one pool. The first error stops further writes of that batch;
 * every error is kept (errno + path + offset). */
#ifndef HPCCKPT_WRITER_H
#define HPCCKPT_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "hpcckpt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hpcckpt_pool hpcckpt_pool;
typedef struct hpcckpt_batch hpcckpt_batch;

/* threads == 0: chosen from the CPU count. Returns NULL (st filled) on failure. */
hpcckpt_pool* hpcckpt_pool_create(unsigned threads, size_t chunk_bytes, hpcckpt_status* st);
unsigned hpcckpt_pool_threads(const hpcckpt_pool* pool);
size_t hpcckpt_pool_chunk_bytes(const hpcckpt_pool* pool);
/* Finishes all queued work, then joins the threads. Idempotent. Blocks. */
void hpcckpt_pool_close(hpcckpt_pool* pool);
/* Close, then free. Every batch of this pool must be destroyed first. */
void hpcckpt_pool_destroy(hpcckpt_pool* pool);

/* direct != 0: the 4 KiB-aligned middle of each chunk goes through O_DIRECT
 * (when the file system supports it), head and tail through the page cache. */
hpcckpt_batch* hpcckpt_batch_create(hpcckpt_pool* pool, int direct);
/* Queue one item: if src is not NULL, copy src -> data first (both len bytes).
 * The buffers must stay valid until wait() reports completion or destroy returns.
 * Returns the item id, or -1 (st filled) after start(). */
int64_t hpcckpt_batch_add(hpcckpt_batch* b, const char* path, uint64_t offset, void* data,
                          const void* src, size_t len, hpcckpt_status* st);
/* Returns 0, or -1 with st filled (already started, pool closed). Errors of
 * the work itself are reported through wait()/hpcckpt_batch_error. */
int hpcckpt_batch_start(hpcckpt_batch* b, hpcckpt_status* st);
int hpcckpt_batch_started(const hpcckpt_batch* b);
/* 1 once every src was copied (or skipped because the batch failed); 0 on
 * timeout. timeout_ns < 0 waits forever. */
int hpcckpt_batch_wait_copied(hpcckpt_batch* b, int64_t timeout_ns);
/* 1 once every write returned and every file was fdatasync'ed and closed. */
int hpcckpt_batch_wait(hpcckpt_batch* b, int64_t timeout_ns);
size_t hpcckpt_batch_error_count(hpcckpt_batch* b);
/* Copies error i into out; returns 0, or -1 if i is out of range. */
int hpcckpt_batch_error(hpcckpt_batch* b, size_t i, hpcckpt_status* out);
size_t hpcckpt_batch_items(const hpcckpt_batch* b);
/* crc32c of item's bytes as written; valid once wait() returned 1 with no errors. */
uint32_t hpcckpt_batch_crc(const hpcckpt_batch* b, size_t item);
uint64_t hpcckpt_batch_bytes_total(const hpcckpt_batch* b);
uint64_t hpcckpt_batch_bytes_copied(const hpcckpt_batch* b);
uint64_t hpcckpt_batch_bytes_written(const hpcckpt_batch* b);
/* Cancels work not yet begun, waits for work in progress, closes files, frees. */
void hpcckpt_batch_destroy(hpcckpt_batch* b);

#ifdef __cplusplus
}
#endif
#endif
