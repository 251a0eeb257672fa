/* Status reporting shared by every core call that can fail.
 * The core never prints and never exits: a failing call fills one of these
 * and returns a nonzero value; the caller decides how to surface it. */
#ifndef HPCCKPT_STATUS_H
#define HPCCKPT_STATUS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HPCCKPT_PATH_MAX 4096

typedef struct hpcckpt_status {
    int err;                       /* errno value; 0 means success */
    const char* op;                /* static string naming the failing call, e.g. "pwrite" */
    int64_t offset;                /* file offset involved, or -1 */
    char path[HPCCKPT_PATH_MAX];   /* file the error is about (may be empty) */
} hpcckpt_status;

void hpcckpt_status_clear(hpcckpt_status* st);
void hpcckpt_status_set(hpcckpt_status* st, int err, const char* op, const char* path, int64_t offset);

#ifdef __cplusplus
}
#endif
#endif
