/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) with the iSCSI /
 * google-crc32c convention: crc32c(0, "123456789", 9) == 0xE3069283 and
 * crc32c(crc32c(0, a), b) == crc32c(0, a || b). */
#ifndef HPCCKPT_CRC32C_H
#define HPCCKPT_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Fastest implementation available on this CPU (chosen once, at first use). */
uint32_t hpcckpt_crc32c(uint32_t crc, const void* data, size_t len);
/* Portable table-driven implementation, always available (tests, benchmarks). */
uint32_t hpcckpt_crc32c_software(uint32_t crc, const void* data, size_t len);
/* Hardware implementation; only valid when hpcckpt_crc32c_impl() is not "software". */
uint32_t hpcckpt_crc32c_hardware(uint32_t crc, const void* data, size_t len);
/* crc of A||B from crc(A), crc(B) and len(B). */
uint32_t hpcckpt_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
/* "sse4.2", "armv8-crc" or "software". */
const char* hpcckpt_crc32c_impl(void);

#ifdef __cplusplus
}
#endif
#endif
