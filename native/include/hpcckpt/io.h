/* Blocking file primitives with errno + path reporting. */
#ifndef HPCCKPT_IO_H
#define HPCCKPT_IO_H

#include <stddef.h>
#include <stdint.h>

#include "hpcckpt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* pwrite every byte, retrying short writes and EINTR. Returns 0 or -1 (st filled). */
int hpcckpt_pwrite_all(int fd, const void* data, size_t len, uint64_t offset,
                       const char* path, hpcckpt_status* st);
/* fdatasync, retrying EINTR. Returns 0 or -1 (st filled with path). */
int hpcckpt_fdatasync(int fd, const char* path, hpcckpt_status* st);

#ifdef __cplusplus
}
#endif
#endif
