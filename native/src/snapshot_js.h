// The snapshot parts of the Vm binding (snapshot_binding.cc), called from
// VmWrap in vmm_binding.cc: restore specs as JS values, and the template,
// branch and memory-accounting methods of a live Vm.
#pragma once
#include <napi.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>

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
// vm.reclaim(): drops the private pages that equal the snapshot's again (vmm/snapshot/reclaim.h).
Napi::Value VmReclaim(const Napi::CallbackInfo& info, vmm::Vm& vm);
// vm.pack(): a dozing VM's private pages packed (vmm/snapshot/packed_pages.h).
Napi::Value VmPack(const Napi::CallbackInfo& info, vmm::Vm& vm);
// vm.capturePattern(dir, others?) -> diff layer; vm.setPattern(layer) (vmm/snapshot/pattern.h).
Napi::Value VmCapturePattern(const Napi::CallbackInfo& info, vmm::Vm& vm);
// The live VM of a Vm object (vmm_binding.cc); throws std::invalid_argument for anything else.
vmm::Vm& VmOf(Napi::Value v);
Napi::Value VmSetPattern(const Napi::CallbackInfo& info, vmm::Vm& vm);
// vm.guestBytes(gpa, length) / vm.writeGuestBytes(gpa, bytes): host-side access
// to guest RAM, for tests and diagnostics.
Napi::Value VmGuestBytes(const Napi::CallbackInfo& info, vmm::Vm& vm);
Napi::Value VmWriteGuestBytes(const Napi::CallbackInfo& info, vmm::Vm& vm);

// Events of a VM created before anyone could listen: buffered until a
// target is set, then forwarded (any thread).
class EventForwarder {
 public:
  void Post(vmm::VmEvent&& e) {
    std::lock_guard<std::mutex> l(mu_);
    if (target_) target_(std::move(e));
    else if (buffered_.size() < 1000) buffered_.push_back(std::move(e));
  }
  void SetTarget(std::function<void(vmm::VmEvent&&)> t) {
    std::lock_guard<std::mutex> l(mu_);
    target_ = std::move(t);
    for (auto& e : buffered_) target_(std::move(e));
    buffered_.clear();
  }

 private:
  std::mutex mu_;
  std::function<void(vmm::VmEvent&&)> target_;
  std::deque<vmm::VmEvent> buffered_;
};

// A VM restored from a snapshot on a worker thread by snapshot.prepareVms()
// (VM creation waits on the kernel, e.g. for an SRCU grace period per memory
// slot, so creating several at once overlaps those waits), not started.
struct PreparedVm {
  std::unique_ptr<vmm::Vm> vm;
  std::shared_ptr<EventForwarder> events;
};
// Takes the VM out of a value made by prepareVms() (once); throws a TypeError
// for anything else or a value already taken.
std::unique_ptr<PreparedVm> TakePreparedVm(Napi::Value v);

}  // namespace forkling
