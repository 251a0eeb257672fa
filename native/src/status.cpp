#include "hpcckpt/status.h"

#include <cstring>

extern "C" void hpcckpt_status_clear(hpcckpt_status* st) {
    st->err = 0;
    st->op = "";
    st->offset = -1;
    st->path[0] = '\0';
}

extern "C" void hpcckpt_status_set(hpcckpt_status* st, int err, const char* op,
                                   const char* path, int64_t offset) {
    st->err = err;
    st->op = op;
    st->offset = offset;
    const char* p = path != nullptr ? path : "";
    std::strncpy(st->path, p, HPCCKPT_PATH_MAX - 1);
    st->path[HPCCKPT_PATH_MAX - 1] = '\0';
}
