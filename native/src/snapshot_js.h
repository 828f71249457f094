// The snapshot parts of the Vm binding (snapshot_binding.cc), called from
// VmWrap in vmm_binding.cc: restore specs as JS values, and the template,
// branch and memory-accounting methods of a live Vm.
#pragma once
#include <napi.h>

#include <memory>

#include "vmm/vm.h"

namespace forkling {

// The spec inside a value made by snapshot.loadTemplate() or vm.branch();
// throws a TypeError for anything else.
std::shared_ptr<const vmm::RestoreSpec> RestoreSpecOf(Napi::Value v);
// vm.saveTemplate(dir): the VM must be paused.
Napi::Value VmSaveTemplate(const Napi::CallbackInfo& info, vmm::Vm& vm);
// vm.branch(dir): pauses, captures, resumes; returns the children's spec and figures.
Napi::Value VmBranch(const Napi::CallbackInfo& info, vmm::Vm& vm);
// vm.memoryUsage(): guest pages private to this VM and shared with the page cache.
Napi::Value VmMemoryUsage(const Napi::CallbackInfo& info, vmm::Vm& vm);

}  // namespace forkling
