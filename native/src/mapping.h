// Memory mappings made by the addon's mmap(), seen from C++ (the VMM hot path
// takes guest RAM as a Mapping object and needs its address and length).
#pragma once
#include <napi.h>
#include <cstddef>

namespace forkling {

struct MappingView {
  void* addr;
  size_t length;
};

// If `v` is a Mapping object that is still mapped, fills `out` and returns true.
// The view is valid only until the mapping's unmap() runs (or it is collected),
// so callers must keep the Mapping object referenced while they use it.
bool GetMapping(Napi::Value v, MappingView* out);

// True if [addr, addr+length) lies inside one live mapping made by mmap().
bool IsLiveMappingRange(uintptr_t addr, size_t length);

}  // namespace forkling
