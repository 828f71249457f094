#include "vmm/snapshot/zero_runs.h"

#include "vmm/snapshot/state_file.h"

namespace forkling::vmm::snapshot {
namespace {

// Zeros shorter than this stay in the literal: a run costs up to two varints.
constexpr size_t kMinRun = 4;

void PutVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t(v) | 0x80);
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

uint64_t GetVarint(const std::vector<uint8_t>& in, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= in.size()) throw CorruptError("squeezed bytes end inside a number");
    const uint8_t b = in[at++];
    if (shift == 63 && b > 1) break;  // (bits past 64)
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  throw CorruptError("squeezed bytes hold a number too long");
}

}  // namespace

std::vector<uint8_t> SqueezeZeros(const std::vector<uint8_t>& bytes) {
  std::vector<uint8_t> out;
  const size_t n = bytes.size();
  size_t at = 0;
  while (at < n) {
    size_t zeros = 0;
    while (at + zeros < n && bytes[at + zeros] == 0) zeros++;
    // The literal ends where a run of kMinRun zeros (or the input) begins.
    const size_t lit = at + zeros;
    size_t end = lit;
    while (end < n) {
      if (bytes[end] != 0) {
        end++;
        continue;
      }
      size_t z = 0;
      while (end + z < n && bytes[end + z] == 0 && z < kMinRun) z++;
      if (z >= kMinRun || end + z == n) break;
      end += z;
    }
    PutVarint(out, zeros);
    PutVarint(out, end - lit);
    out.insert(out.end(), bytes.begin() + lit, bytes.begin() + end);
    at = end;
  }
  out.shrink_to_fit();
  return out;
}

std::vector<uint8_t> ExpandZeros(const std::vector<uint8_t>& squeezed, size_t max_bytes) {
  std::vector<uint8_t> out;
  size_t at = 0;
  while (at < squeezed.size()) {
    const uint64_t zeros = GetVarint(squeezed, at);
    const uint64_t lit = GetVarint(squeezed, at);
    if (zeros > max_bytes - out.size() || lit > max_bytes - out.size() - zeros)
      throw CorruptError("squeezed bytes expand past their limit");
    if (lit > squeezed.size() - at) throw CorruptError("squeezed bytes end inside a literal");
    out.insert(out.end(), size_t(zeros), uint8_t(0));
    out.insert(out.end(), squeezed.begin() + at, squeezed.begin() + at + lit);
    at += lit;
  }
  return out;
}

}  // namespace forkling::vmm::snapshot
