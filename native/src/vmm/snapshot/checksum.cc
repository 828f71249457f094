#include "vmm/snapshot/checksum.h"

#include <cpuid.h>
#include <nmmintrin.h>

#include <cstring>

namespace forkling::vmm::snapshot {
namespace {

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
      t[i] = c;
    }
  }
};

uint32_t SoftCrc(const uint8_t* p, size_t len, uint32_t crc) {
  static const Table table;
  for (size_t i = 0; i < len; i++) crc = table.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t HardCrc(const uint8_t* p, size_t len, uint32_t crc) {
  uint64_t c = crc;
  while (len >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    len -= 8;
  }
  uint32_t c32 = uint32_t(c);
  while (len--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool HaveSse42() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_SSE4_2) != 0;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t len, uint32_t crc) {
  static const bool hw = HaveSse42();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  crc = hw ? HardCrc(p, len, crc) : SoftCrc(p, len, crc);
  return ~crc;
}

bool IsZero(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  // Eight words at a time, OR-ed: one branch per 64 bytes.
  size_t i = 0;
  for (; i + 64 <= len; i += 64) {
    uint64_t w[8];
    std::memcpy(w, p + i, 64);
    if ((w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) != 0) return false;
  }
  for (; i < len; i++)
    if (p[i]) return false;
  return true;
}

}  // namespace forkling::vmm::snapshot
