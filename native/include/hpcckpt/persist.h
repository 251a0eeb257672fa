/* Persistence barriers for DAX / persistent-memory mappings.
 * On ordinary page-cache files only fdatasync makes data durable; there the
 * fence only orders a later commit record after the data stores. */
#ifndef HPCCKPT_PERSIST_H
#define HPCCKPT_PERSIST_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* "clwb", "clflushopt", "clflush", "dc cvap", "dc cvac" or "none"; chosen at run time. */
const char* hpcckpt_barrier_kind(void);
/* Cache line size used by hpcckpt_persist_range, in bytes. */
size_t hpcckpt_cache_line_bytes(void);
/* Write back every cache line overlapping [data, data+len), then fence. */
void hpcckpt_persist_range(const void* data, size_t len);
/* Order all earlier stores before later ones (sfence / dsb ish). */
void hpcckpt_store_fence(void);

#ifdef __cplusplus
}
#endif
#endif
