// Fixed-size fields in byte buffers (the state file, packed pages), copied
// in and out with memcpy: no alignment is assumed, host byte order.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

namespace forkling::vmm::snapshot {

template <class T>
void Append(std::vector<uint8_t>& b, T v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}

template <class T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace forkling::vmm::snapshot
