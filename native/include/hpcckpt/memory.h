/* Staging memory: aligned allocation, prefaulting, and a parallel memcpy. */
#ifndef HPCCKPT_MEMORY_H
#define HPCCKPT_MEMORY_H

#include <stddef.h>

#include "hpcckpt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* posix_memalign'd block; when prefault != 0 every page is written once so
 * later copies take no first-touch page faults. Returns NULL and fills st on failure.
 * Free with hpcckpt_aligned_free. */
void* hpcckpt_aligned_alloc(size_t nbytes, size_t alignment, int prefault, hpcckpt_status* st);
void hpcckpt_aligned_free(void* p);

/* memcpy split over `threads` threads (0 = choose from size and CPU count). */
void hpcckpt_parallel_copy(void* dst, const void* src, size_t len, unsigned threads);

#ifdef __cplusplus
}
#endif
#endif
