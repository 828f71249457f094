// A dozing, packed VM without its KVM VM (vm.h Shelve, Unshelve). What KVM
// holds in the kernel for a VM (the VM and vCPU structures, the irqchip and
// PIT, the vCPU threads' kernel stacks) is several times what a packed idle
// child keeps of its own; the shelf keeps only KVM's state of it, read as a
// template's is (kvm_state.h), and the VM is made again when input comes.
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

#include "vmm/snapshot/kvm_state.h"
#include "vmm/snapshot/state_file.h"
#include "vmm/snapshot/vm_shelf.h"
#include "vmm/snapshot/zero_runs.h"
#include "vmm/vm.h"

namespace forkling::vmm {
namespace {

constexpr uint32_t kMsrTsc = 0x10;
// What a shelf's state may expand to: far above the ~10 KiB a vCPU takes.
constexpr size_t kMaxShelfStateBytes = 64u << 20;

uint64_t BootNs() {
  timespec t;
  clock_gettime(CLOCK_BOOTTIME, &t);
  return uint64_t(t.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec);
}

}  // namespace

bool Vm::Shelve() {
  // Pack calls this with the VM held and dozing, the vsock loop held, pack_mu_ taken and the
  // memslots removed: no vCPU is in KVM_RUN and nothing else uses the KVM VM.
  if (shelf_ || vm_fd_ < 0 || stop_flag_) return false;
  {
    std::lock_guard<std::mutex> l(halt_mu_);
    if (halt_hint_) return false;  // (it said it powers off: the halt watch reads its vCPUs)
  }
  auto shelf = std::make_unique<snapshot::Shelf>();
  try {
    std::vector<snapshot::Section> sections;
    snapshot::CaptureKvmSections(kvm_fd_, vm_fd_, VcpuFds(), sections);
    for (auto& v : vcpus_) {
      const int khz = ioctl(v->fd, KVM_GET_TSC_KHZ, 0);
      shelf->tsc_khz.push_back(khz > 0 ? uint64_t(khz) : 0);
    }
    shelf->state = snapshot::SqueezeZeros(snapshot::EncodeStateFile(sections));
  } catch (const std::exception&) {
    return false;  // (it stays a KVM VM, as it was)
  }
  shelf->at_ns = BootNs();
  // The vCPU threads leave their loops (each counts itself exited, so WaitStopped sees them stopped).
  {
    std::lock_guard<std::mutex> l(run_mu_);
    shelving_ = true;
    // (not kicked any more: KickAll skips them; a kick racing with this would be a stop, from a
    // thread that cannot run now: the vsock loop is held)
    for (auto& v : vcpus_) v->in_thread = false;
    run_cv_.notify_all();
  }
  for (auto& v : vcpus_)
    if (v->thread.joinable()) v->thread.join();
  {
    std::lock_guard<std::mutex> l(run_mu_);
    shelving_ = false;
  }
  for (auto& v : vcpus_) {
    if (v->run) munmap(v->run, v->run_size);
    if (v->fd >= 0) close(v->fd);
    v->run = nullptr;
    v->fd = -1;
    v->stack_lo = 0;
    v->stack_size = 0;
  }
  kvm_stats_.reset();  // (its file holds the VM too)
  close(vm_fd_);
  vm_fd_ = -1;
  shelf_ = std::move(shelf);
  shelves_++;
  return true;
}

void Vm::Unshelve() {
  // Under pack_mu_ (Unpack), the VM's pages already written back.
  if (!shelf_ || stop_flag_) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<snapshot::Shelf> shelf = std::move(shelf_);
  uint32_t started = 0;
  bool counted = false;  // exited_count_ no longer counts the threads that are to start
  try {
    CreateKvmVm();
    // (before the vCPUs' MSRs: KVM maps the guest's kvm-clock page when they are set)
    if (!AddMemslots()) throw std::system_error(errno, std::generic_category(), "KVM_SET_USER_MEMORY_REGION");
    memslots_removed_ = false;
    for (uint32_t i = 0; i < vcpus_.size(); i++) OpenVcpu(*vcpus_[i], i);
    const std::string what = "its shelf";
    const std::vector<uint8_t> bytes = snapshot::ExpandZeros(shelf->state, kMaxShelfStateBytes);
    snapshot::KvmState k = snapshot::DecodeKvmSections(snapshot::DecodeStateFile(bytes.data(), bytes.size(), what), uint32_t(vcpus_.size()), what);
    // Time went on while it was away, as for a VM that dozed: kvm-clock and each TSC advance by it.
    const uint64_t away = BootNs() - shelf->at_ns;
    k.vm.clock.clock += away;
    snapshot::RestoreVm(vm_fd_, k.vm);
    for (uint32_t i = 0; i < vcpus_.size(); i++) {
      snapshot::VcpuState& s = k.vcpus[i];
      if (const uint64_t khz = shelf->tsc_khz[i])
        for (kvm_msr_entry& m : s.msrs)
          if (m.index == kMsrTsc) m.data += uint64_t((unsigned __int128)away * khz / 1000000u);
      snapshot::RestoreVcpu(vm_fd_, vcpus_[i]->fd, s);
    }
    {
      std::lock_guard<std::mutex> l(run_mu_);
      exited_count_ -= uint32_t(vcpus_.size());
      counted = true;
      for (auto& v : vcpus_) v->clock_stopped = true;  // (KVM_KVMCLOCK_CTRL: it was stopped, not stuck)
    }
    for (; started < vcpus_.size(); started++) StartVcpuThread(started);
  } catch (const std::exception& e) {
    if (counted) {
      std::lock_guard<std::mutex> l(run_mu_);
      exited_count_ += uint32_t(vcpus_.size()) - started;  // (those that never started)
    }
    // (what it made is closed by Kill; stopped, it is never unshelved again)
    RequestStop("error", std::string("its KVM VM could not be made again as it woke: ") + e.what());
    return;
  }
  last_unshelve_ns_ = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace forkling::vmm
