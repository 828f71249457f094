// One KVM virtual machine in the host process: guest RAM, the in-kernel
// irqchip and PIT, the legacy devices, PCI with virtio-vsock and virtio-rng,
// and one thread per vCPU running KVM_RUN. Every exit is handled here in C++;
// the owner hears about what matters (console lines, the VM stopping, device
// failures) through an event callback, called from vCPU or device threads,
// never once per exit for anything but console lines (which it batches).
#pragma once
#include <linux/kvm.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "vmm/guest_ram.h"
#include "vmm/kvm_stats.h"
#include "vmm/legacy_devices.h"
#include "vmm/pci.h"
#include "vmm/snapshot/state_file.h"
#include "vmm/vmm_thread.h"

namespace forkling::vmm {

class VirtioPciDevice;
class VirtioVsock;
namespace snapshot {
class DiffLayer;
class PackedPages;
class PatternBacking;
struct PackResult;
struct Shelf;
}

// An open file descriptor shared by the specs and VMs that use it; closed
// with the last of them.
class SharedFd {
 public:
  explicit SharedFd(int fd) : fd_(fd) {}
  ~SharedFd();
  SharedFd(const SharedFd&) = delete;
  SharedFd& operator=(const SharedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Where a restored VM's RAM and state come from (vmm/snapshot/vm_snapshot.cc):
// a template's memory file mapped MAP_PRIVATE, branch diff layers mapped over
// it (oldest first), and the saved state sections.
struct RestoreSpec {
  std::string what;  // for errors, e.g. "template py"
  std::string memory_path;
  // The memory file as opened and checked when the template was loaded:
  // children map it and reclaim compares with it even if the template is
  // replaced or removed meanwhile.
  std::shared_ptr<const SharedFd> memory_fd;
  std::vector<std::shared_ptr<snapshot::DiffLayer>> layers;
  std::vector<snapshot::Section> state;
  uint64_t memory_bytes = 0;
  uint32_t vcpus = 0;
};

struct VmConfig {
  uint64_t memory_bytes = 512ull << 20;
  uint32_t vcpus = 1;
  std::string kernel_path;
  std::string initrd_path;  // optional
  std::string cmdline;
  std::string vsock_path;   // Unix socket of the vsock device (empty: no vsock)
  uint64_t vsock_cid = 3;
  bool rng = true;
};

struct VmEvent {
  enum class Type { kConsole, kStopped, kDeviceError };
  Type type;
  // kStopped: "reset" (i8042 / guest reboot), "panic" (reset after a kernel
  // panic), "triple-fault", "internal-error", "fail-entry", "system-event",
  // "error" (a host-side failure). kDeviceError: the device name.
  std::string reason;
  std::string message;
  std::string line;  // kConsole
};

// Throws std::runtime_error unless a VM may have this many vCPUs and bytes of
// memory (a boot's options, and a snapshot's, which a state file says).
void CheckVmSize(uint64_t vcpus, uint64_t memory_bytes);

class Vm {
 public:
  using EventFn = std::function<void(VmEvent&&)>;

  // Creates the VM, loads the kernel and initrd, sets up the vCPUs. Throws
  // std::runtime_error (or std::system_error) with a message for people.
  Vm(const VmConfig& cfg, EventFn on_event);
  // Restores a snapshot instead of booting (vm_snapshot.cc): RAM from the
  // spec, KVM and device state restored; Start() continues the guest.
  // cfg.memory_bytes and cfg.vcpus must match the spec.
  Vm(const VmConfig& cfg, EventFn on_event, std::shared_ptr<const RestoreSpec> restore);
  ~Vm();
  Vm(const Vm&) = delete;
  Vm& operator=(const Vm&) = delete;

  void Start();
  // The owner's pause (the sandbox's pause/resume): returns once every vCPU
  // is out of KVM_RUN and waiting. Not counted: one Resume undoes any Pauses.
  void Pause();
  void Resume();
  // A hold of the VMM's own (branch, reclaim, debug dump, poweroff check),
  // counted and apart from the owner's pause, so that neither ends the
  // other: the vCPUs run only when no hold is left and the owner has not
  // paused. Returns once every vCPU is out of KVM_RUN.
  void Hold();
  void Release();
  // Doze: an idle guest's vCPUs wait outside KVM_RUN, so its timer ticks
  // write no page and cost no host CPU. The owner dozes a VM only when
  // nothing in it would run without input (the agent's `quiet`); input for
  // the guest (a vsock connection or bytes from the host, an interrupt for
  // it) wakes it, and each vCPU tells the guest through kvm-clock that it
  // was stopped (KVM_KVMCLOCK_CTRL: no soft-lockup or RCU stall report for
  // the time it slept). Apart from the owner's pause and the holds. False
  // when the VM does not run.
  bool Doze();
  void Wake();
  bool dozing() const { return dozing_.load(); }
  // Pack (vmm/snapshot/packed_pages.h): a dozing VM's private pages kept as
  // the bytes in which they differ from what backs them, the pages given
  // back. Nothing unless the VM is restored, dozes and holds nothing packed.
  // With nothing left private, the pack frees the VM's page tables
  // (DropRamTables) and then shelves the KVM VM itself (Shelve). Unpack
  // writes them back, and makes the KVM VM again if it was shelved; every
  // reader and writer of guest RAM and every user of the KVM VM calls it
  // first (vCPUs before KVM_RUN, Hold, Pause, the vsock loop's passes, an
  // interrupt for the guest), and it costs one atomic load when nothing is
  // packed. Any thread.
  snapshot::PackResult Pack(bool shelve = true);
  void Unpack();
  // Stops the vCPUs, joins every thread, resets the devices and frees guest
  // RAM. Idempotent. Must not be called from a vCPU thread.
  void Kill();

  struct Stats {
    uint64_t memory_bytes;
    uint64_t resident_bytes;  // guest pages backed by host memory
    // Counters host_vcpu_stack_bytes and host_kvm_run_bytes (resident), and
    // host_npt_min_bytes: the fewest table pages of KVM's nested page table
    // that hold the entries KVM says it maps (0 where the kernel has no
    // binary stats). The host's own page tables for guest RAM come from
    // snapshot::MeasureGuestMemory (a pagemap walk, kept out of this cheap call).
    std::vector<std::pair<std::string, uint64_t>> counters;
  };
  Stats GetStats();
  // Registers of every vCPU, for diagnosing a guest that hangs (pauses the
  // vCPUs for the moment it takes).
  std::string DebugState();
  bool running() const { return started_ && !stopped_; }

  // Snapshot support (vm_snapshot.cc). SaveState needs the VM paused; it
  // holds the vsock device still while it reads it and returns the state
  // sections (KVM, vCPUs, devices).
  std::vector<snapshot::Section> SaveState();
  const GuestRam& ram() const { return ram_; }
  // What this VM was restored from (null for a booted VM).
  std::shared_ptr<const RestoreSpec> origin() const { return origin_; }
  VirtioVsock* vsock() const { return vsock_.get(); }
  // Branch pre-copy (vm_snapshot.cc): KVM dirty-page logging of guest RAM,
  // the RAM pages (offsets from ram().host() / 4096) the guest wrote since
  // the last call (clears the log), and the pages virtio-rng may write from
  // a vCPU thread (its rings and posted buffers: KVM does not log those).
  void SetDirtyLogging(bool on);
  std::vector<uint64_t> TakeDirtyPages();
  std::vector<uint64_t> RngWritablePages();
  bool stopped() const { return stopped_; }
  // The pattern this VM maps equal pages from at reclaim
  // (vmm/snapshot/pattern.h), set once; null until then.
  void SetPattern(std::shared_ptr<const snapshot::DiffLayer> layer);
  // Stops the VM for a host-side failure ("error"), as a device model does.
  void Fail(const std::string& message) { RequestStop("error", message); }
  // What to say once ram().memory().lost(): a file its RAM maps was cut short.
  std::string RamLostMessage() const;
  // Whether the template's memory file is shorter now than this VM's RAM
  // (the kernel's own reads of such RAM fail with EFAULT: no SIGBUS, no lost()).
  bool MemoryFileCut() const;
  snapshot::PatternBacking* pattern() const { return pattern_.get(); }

 private:
  struct Vcpu {
    int fd = -1;
    kvm_run* run = nullptr;
    size_t run_size = 0;
    VmmThread thread;
    pthread_t tid{};
    std::atomic<bool> in_thread{false};
    // The thread's stack, set by the thread itself (for GetStats).
    std::atomic<uintptr_t> stack_lo{0};
    std::atomic<size_t> stack_size{0};
    std::atomic<bool> clock_stopped{false};  // dozed: KVM_KVMCLOCK_CTRL before it runs again
  };
  enum Exit { kExitIo, kExitMmio, kExitIntr, kExitHlt, kExitShutdown, kExitSystemEvent, kExitInternal,
              kExitFailEntry, kExitOther, kExitKinds };

  void SetupVm();
  void RestoreRam(const RestoreSpec& spec);    // vm_snapshot.cc
  void RestoreState(const RestoreSpec& spec);  // vm_snapshot.cc
  void SetupMemory();
  // KVM memory slots for guest RAM (SetupMemory; Unpack after DropRamTables). False on failure.
  bool AddMemslots();
  // Pack's second step, with no private page left (vm_snapshot.cc): its memslots removed, so
  // that KVM frees its nested page tables, and its RAM mapped anew as restored, so that the
  // host's page tables for it go with the old mapping. Unpack adds the memslots back.
  bool DropRamTables();
  // RAM mapped as a restore maps it (memory file, diff layers, pattern stretches), in place
  // (Unpack after DropRamTables). Throws std::system_error or std::runtime_error.
  void MapRamAgain();
  // Pack's third step (snapshot/vm_shelf.cc), once the memslots are gone: KVM's state of the VM
  // and its vCPUs is read into the shelf, the vCPU threads end and the KVM VM is closed, so that
  // a dozing VM holds none of KVM's kernel structures (VM, vCPUs, irqchip, PIT, their threads'
  // kernel stacks). Unshelve (in Unpack, before the memslots come back) makes it again from the
  // shelf with its clocks advanced by the time it was away, and starts the vCPU threads.
  bool Shelve();
  void Unshelve();
  // KVM_CREATE_VCPU for vcpu `index` into `v`, its kvm_run mapped, its CPUID set (SetupVcpu, Unshelve).
  void OpenVcpu(Vcpu& v, uint32_t index);
  std::vector<int> VcpuFds() const {
    std::vector<int> fds;
    for (const auto& v : vcpus_) fds.push_back(v->fd);
    return fds;
  }
  // KVM_CREATE_VM and the in-kernel irqchip and PIT (SetupVm, Unshelve).
  void CreateKvmVm();
  void StartVcpuThread(uint32_t index);
  void LoadGuest();
  void SetupDevices();
  void SetupVcpu(uint32_t index);
  void SetupBootRegisters(Vcpu& v, uint64_t entry);
  void VcpuLoop(uint32_t index);
  static std::string VcpuRegs(const Vcpu& v);
  void HandleIo(kvm_run* run);
  void HandleMmio(kvm_run* run);
  void RequestStop(const std::string& reason, const std::string& message);
  void KickAll();
  // Kicks every vCPU out of KVM_RUN and waits until each waits or has exited.
  void WaitStopped();
  void IrqPulse(uint32_t irq);
  void SignalMsi(uint64_t address, uint32_t data);
  void ConsoleByte(uint8_t b);
  void HaltWatch();

  VmConfig cfg_;
  EventFn on_event_;
  std::shared_ptr<const RestoreSpec> origin_;
  std::shared_ptr<snapshot::PatternBacking> pattern_;
  int kvm_fd_ = -1;
  std::atomic<int> vm_fd_{-1};
  GuestRam ram_;
  std::vector<std::unique_ptr<Vcpu>> vcpus_;
  uint64_t entry_ = 0;

  // Devices; every port/MMIO access runs under io_mu_.
  std::mutex io_mu_;
  std::unique_ptr<Uart8250> uart_;
  std::unique_ptr<I8042> i8042_;
  std::unique_ptr<CmosRtc> rtc_;
  std::unique_ptr<PciBus> pci_;
  std::vector<std::shared_ptr<VirtioPciDevice>> virtio_;
  std::shared_ptr<VirtioVsock> vsock_;
  std::string console_line_;
  std::atomic<bool> panicked_{false};
  // Poweroff without ACPI: the kernel prints "reboot: Power down" (or "System
  // halted") and halts every CPU with interrupts off. The console line wakes
  // this thread (started then), which confirms that state and ends the VM.
  VmmThread halt_thread_;
  std::mutex halt_mu_;
  std::condition_variable halt_cv_;
  bool halt_hint_ = false;

  // Run state.
  std::atomic<bool> started_{false};
  std::atomic<bool> stopped_{false};   // the guest stopped or Kill() ran
  std::atomic<bool> stop_flag_{false}; // vCPU threads must leave their loop
  std::atomic<bool> killed_{false};
  std::mutex run_mu_;
  std::condition_variable run_cv_;
  bool pause_requested_ = false;  // by the owner
  uint32_t holds_ = 0;
  std::atomic<bool> dozing_{false};  // changed under run_mu_
  uint64_t dozes_ = 0;
  std::chrono::steady_clock::time_point doze_t0_;
  std::chrono::steady_clock::duration dozed_{};
  uint32_t paused_count_ = 0;
  uint32_t exited_count_ = 0;

  // Packed pages: set and taken under pack_mu_ (Pack holds the VM still; Unpack runs before anything else touches RAM).
  std::mutex pack_mu_;
  std::unique_ptr<snapshot::PackedPages> packed_;
  std::atomic<bool> packed_flag_{false};
  bool memslots_removed_ = false;
  bool ram_reserved_ = false;  // DropRamTables left one inaccessible mapping over RAM
  std::atomic<uint64_t> packed_pages_{0}, packed_bytes_{0}, packs_{0}, unpacks_{0}, last_unpack_ns_{0};
  // Shelved (Shelve): set and taken under pack_mu_; the vCPU threads leave their loop while
  // shelving_ is set (under run_mu_). vm_fd_ is -1 while shelved.
  std::unique_ptr<snapshot::Shelf> shelf_;
  bool shelving_ = false;
  std::atomic<uint64_t> shelves_{0}, last_unshelve_ns_{0};

  std::atomic<uint64_t> exits_[kExitKinds] = {};
  std::atomic<uint64_t> console_bytes_{0};
  std::unique_ptr<KvmStats> kvm_stats_;  // opened at the first GetStats
};

// Holds a VM's vCPUs and its vsock loop, the writers of guest RAM, still
// while it lives (reclaim, pattern capture): the vsock loop first, then the
// vCPUs; let go in the other order.
class HeldStill {
 public:
  explicit HeldStill(Vm& vm);
  ~HeldStill() { Let(); }
  HeldStill(const HeldStill&) = delete;
  HeldStill& operator=(const HeldStill&) = delete;
  // Lets the VM go on (once); returns how long its vCPUs were held, in ns.
  uint64_t Let();
  // A VM being stopped for a failure keeps its vsock loop held.
  void KeepVsockHeld() { keep_vsock_ = true; }

 private:
  Vm& vm_;
  VirtioVsock* vsock_;
  std::chrono::steady_clock::time_point t0_;
  bool held_ = true, keep_vsock_ = false;
};

}  // namespace forkling::vmm
