// Bytes kept in memory with their runs of zeros squeezed out: a shelved VM's
// KVM state (vm_shelf.cc) is mostly zeros (the XSAVE area's unused
// components, the LAPIC's reserved words, MSRs that read 0), and a child
// keeps it for as long as it sleeps.
//
//   repeated: varint zeros | varint literal length | the literal bytes
//
// Varints are LEB128 (7 bits a byte, low first).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace forkling::vmm::snapshot {

std::vector<uint8_t> SqueezeZeros(const std::vector<uint8_t>& bytes);
// Throws CorruptError (state_file.h) for input that ends inside a token,
// holds a number past 64 bits, or expands past `max_bytes`.
std::vector<uint8_t> ExpandZeros(const std::vector<uint8_t>& squeezed, size_t max_bytes);

}  // namespace forkling::vmm::snapshot
