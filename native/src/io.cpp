#include "hpcckpt/io.h"

#include <unistd.h>

#include <cerrno>

extern "C" int hpcckpt_pwrite_all(int fd, const void* data, size_t len, uint64_t offset,
                                  const char* path, hpcckpt_status* st) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (len != 0) {
        ssize_t n = ::pwrite(fd, p, len, static_cast<off_t>(offset));
        if (n < 0) {
            if (errno == EINTR) continue;
            hpcckpt_status_set(st, errno, "pwrite", path, static_cast<int64_t>(offset));
            return -1;
        }
        if (n == 0) {
            // A zero-byte pwrite for a nonzero request means the device is full.
            hpcckpt_status_set(st, ENOSPC, "pwrite", path, static_cast<int64_t>(offset));
            return -1;
        }
        p += n;
        len -= static_cast<size_t>(n);
        offset += static_cast<uint64_t>(n);
    }
    return 0;
}

extern "C" int hpcckpt_fdatasync(int fd, const char* path, hpcckpt_status* st) {
    while (::fdatasync(fd) != 0) {
        if (errno == EINTR) continue;
        hpcckpt_status_set(st, errno, "fdatasync", path, -1);
        return -1;
    }
    return 0;
}
