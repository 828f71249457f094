// CRC32C (Castagnoli), the checksum of every snapshot file: SSE4.2's crc32
// instruction where the CPU has it (several GB/s, so a template's memory file
// can be verified in tens of milliseconds), a table otherwise. Same result both
// ways; the standard check value of "123456789" is 0xe3069283.
#pragma once
#include <cstddef>
#include <cstdint>

namespace forkling::vmm::snapshot {

// Continues a CRC: Crc32c(b, n2, Crc32c(a, n1)) == Crc32c(a||b).
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);

// True when every byte of the page-sized (len % 8 == 0) block is zero.
bool IsZero(const void* data, size_t len);

}  // namespace forkling::vmm::snapshot
