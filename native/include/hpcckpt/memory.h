/* Staging memory: aligned allocation, prefaulting, and a parallel memcpy. */
#ifndef HPCCKPT_MEMORY_H
#define HPCCKPT_MEMORY_H

#include <stddef.h>

#include "hpcckpt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flags of hpcckpt_aligned_alloc. */
#define HPCCKPT_ALLOC_PREFAULT 1u /* write every page once now: later copies take no page faults */
#define HPCCKPT_ALLOC_HUGE 2u     /* blocks >= 4 MiB: 2 MiB-aligned, MADV_HUGEPAGE. Worth it for
                                     memory reused many times (staging); for one-shot memory the
                                     kernel's compaction on first touch can cost more than it saves */

/* posix_memalign'd block of nbytes (flags: HPCCKPT_ALLOC_*). Returns NULL and
 * fills st on failure. Free with hpcckpt_aligned_free. */
void* hpcckpt_aligned_alloc(size_t nbytes, size_t alignment, unsigned flags, hpcckpt_status* st);
void hpcckpt_aligned_free(void* p);

/* CPUs this thread may run on (its affinity mask: a Slurm job's cpuset, not
 * the whole node), at least 1. The default of every thread count in the core. */
unsigned hpcckpt_usable_cpus(void);

/* memcpy split over `threads` threads (0 = choose from size and usable CPUs). */
void hpcckpt_parallel_copy(void* dst, const void* src, size_t len, unsigned threads);

#ifdef __cplusplus
}
#endif
#endif
