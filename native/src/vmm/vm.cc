#include "vmm/vm.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "vmm/boot_loader.h"
#include "vmm/layout.h"
#include "vmm/mptable.h"
#include "vmm/virtio_pci.h"
#include "vmm/virtio_rng.h"
#include "vmm/snapshot/packed_pages.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/snapshot/vm_shelf.h"
#include "vmm/virtio_vsock.h"

namespace forkling::vmm {
namespace {

// Failures of one device reported to the host before they are only counted.
constexpr uint32_t kMaxDeviceErrorReports = 8;

// vCPU threads are kicked out of KVM_RUN with this signal (plus
// kvm_run.immediate_exit, which closes the race with a thread about to enter).
int KickSignal() { return SIGRTMIN + 7; }

void InstallKickHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_handler = [](int) {};
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: KVM_RUN must return EINTR
    sigaction(KickSignal(), &sa, nullptr);
  });
}

// <linux/kvm.h> declares the variable-length structs with __DECLARE_FLEX_ARRAY,
// which in C++ adds a 1-byte empty struct: sizeof(kvm_cpuid2) becomes 12, and
// so does the size encoded in the ioctl number, which KVM then rejects with
// EINVAL. These are the numbers as C computes them (header of 8 bytes).
struct FlexHeader {
  uint32_t count;
  uint32_t padding;
};
static_assert(sizeof(FlexHeader) == 8);
constexpr unsigned long kGetSupportedCpuid = _IOWR(KVMIO, 0x05, FlexHeader);
constexpr unsigned long kSetCpuid2 = _IOW(KVMIO, 0x90, FlexHeader);
constexpr unsigned long kSetMsrs = _IOW(KVMIO, 0x89, FlexHeader);

[[noreturn]] void ThrowErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

int Ioctl(int fd, unsigned long req, unsigned long arg, const char* what) {
  int r = ioctl(fd, req, arg);
  if (r < 0) ThrowErrno(what);
  return r;
}
int Ioctl(int fd, unsigned long req, const void* arg, const char* what) {
  return Ioctl(fd, req, reinterpret_cast<unsigned long>(arg), what);
}

std::vector<uint8_t> ReadFile(const std::string& path, const char* what) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) ThrowErrno(std::string("cannot open the ") + what + " " + path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    ThrowErrno(std::string("cannot stat the ") + what + " " + path);
  }
  std::vector<uint8_t> data(size_t(st.st_size));
  size_t got = 0;
  while (got < data.size()) {
    ssize_t n = pread(fd, data.data() + got, data.size() - got, off_t(got));
    if (n <= 0) {
      close(fd);
      if (n == 0) errno = EIO;
      ThrowErrno(std::string("cannot read the ") + what + " " + path);
    }
    got += size_t(n);
  }
  close(fd);
  return data;
}

// kvm_pvm (a software nested-virtualization KVM using shadow paging, as on
// this project's development machines) emulates guest writes to pages it
// shadows, and its emulator has no CMPXCHG16B: SLUB's cmpxchg_double on such a
// page stops the VM with an emulation failure. Without CX16 the guest uses its
// lock-based path. Real hardware KVM keeps the bit.
bool HostIsPvm() {
  struct stat st;
  return stat("/sys/module/kvm_pvm", &st) == 0;
}

uint32_t CeilLog2(uint32_t n) {
  uint32_t b = 0;
  while ((1u << b) < n) b++;
  return b;
}

}  // namespace

void CheckVmSize(uint64_t vcpus, uint64_t memory_bytes) {
  if (vcpus < 1 || vcpus > kMaxVcpus) throw std::runtime_error("vcpus must be between 1 and " + std::to_string(kMaxVcpus));
  if (memory_bytes < (32ull << 20) || memory_bytes > layout::kMaxRam || (memory_bytes & ((2ull << 20) - 1)))
    throw std::runtime_error("memory must be a multiple of 2 MiB between 32 MiB and 1 TiB");
}

Vm::Vm(const VmConfig& cfg, EventFn on_event) : cfg_(cfg), on_event_(std::move(on_event)) {
  CheckVmSize(cfg_.vcpus, cfg_.memory_bytes);
  InstallKickHandler();
  try {
    SetupVm();
    SetupMemory();
    LoadGuest();
    SetupDevices();
    for (uint32_t i = 0; i < cfg_.vcpus; i++) SetupVcpu(i);
  } catch (...) {
    Kill();
    throw;
  }
}

Vm::Vm(const VmConfig& cfg, EventFn on_event, std::shared_ptr<const RestoreSpec> restore)
    : cfg_(cfg), on_event_(std::move(on_event)), origin_(std::move(restore)) {
  if (!origin_) throw std::invalid_argument("no snapshot to restore");
  if (cfg_.vcpus != origin_->vcpus || cfg_.memory_bytes != origin_->memory_bytes)
    throw std::runtime_error(origin_->what + ": the VM must have the snapshot's memory size and vCPU count");
  CheckVmSize(cfg_.vcpus, cfg_.memory_bytes);
  InstallKickHandler();
  try {
    SetupVm();
    RestoreRam(*origin_);
    SetupMemory();
    SetupDevices();
    for (uint32_t i = 0; i < cfg_.vcpus; i++) SetupVcpu(i);
    RestoreState(*origin_);
  } catch (...) {
    Kill();
    throw;
  }
}

Vm::~Vm() { Kill(); }

void Vm::SetupVm() {
  kvm_fd_ = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (kvm_fd_ < 0) ThrowErrno("cannot open /dev/kvm");
  if (ioctl(kvm_fd_, KVM_GET_API_VERSION, 0) != KVM_API_VERSION)
    throw std::runtime_error("/dev/kvm speaks an unexpected KVM API version");
  CreateKvmVm();
}

void Vm::CreateKvmVm() {
  vm_fd_ = Ioctl(kvm_fd_, KVM_CREATE_VM, 0ul, "KVM_CREATE_VM");
  Ioctl(vm_fd_, KVM_SET_TSS_ADDR, layout::kTssAddr, "KVM_SET_TSS_ADDR");
  uint64_t idmap = layout::kIdentityMapAddr;
  Ioctl(vm_fd_, KVM_SET_IDENTITY_MAP_ADDR, &idmap, "KVM_SET_IDENTITY_MAP_ADDR");
  Ioctl(vm_fd_, KVM_CREATE_IRQCHIP, 0ul, "KVM_CREATE_IRQCHIP");
  kvm_pit_config pit;
  std::memset(&pit, 0, sizeof pit);
  Ioctl(vm_fd_, KVM_CREATE_PIT2, &pit, "KVM_CREATE_PIT2");
}

void Vm::SetupMemory() {
  if (!ram_.host()) ram_ = GuestRam::CreateAnonymous(cfg_.memory_bytes);  // else restored (RestoreRam)
  if (!AddMemslots()) ThrowErrno("KVM_SET_USER_MEMORY_REGION");
}

bool Vm::AddMemslots() {
  const GuestMemory& m = ram_.memory();
  for (size_t i = 0; i < m.region_count(); i++) {
    const GuestRegion& r = m.region(i);
    kvm_userspace_memory_region reg;
    std::memset(&reg, 0, sizeof reg);
    reg.slot = uint32_t(i);
    reg.guest_phys_addr = r.gpa;
    reg.memory_size = r.size;
    reg.userspace_addr = reinterpret_cast<uint64_t>(r.host);
    if (ioctl(vm_fd_, KVM_SET_USER_MEMORY_REGION, &reg) != 0) return false;
  }
  return true;
}

void Vm::LoadGuest() {
  const GuestMemory& mem = ram_.memory();
  std::vector<uint8_t> kernel = ReadFile(cfg_.kernel_path, "kernel");
  KernelInfo k;
  std::string err;
  if (!ParseKernel(kernel.data(), kernel.size(), &k, &err)) throw std::runtime_error(cfg_.kernel_path + ": " + err);
  LoadedKernel lk;
  if (!LoadKernel(mem, kernel.data(), kernel.size(), k, &lk, &err)) throw std::runtime_error(err);
  entry_ = lk.entry;

  uint64_t initrd_addr = 0, initrd_size = 0;
  if (!cfg_.initrd_path.empty()) {
    int fd = open(cfg_.initrd_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) ThrowErrno("cannot open the initrd " + cfg_.initrd_path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      ThrowErrno("cannot stat the initrd");
    }
    initrd_size = uint64_t(st.st_size);
    initrd_addr = PlaceInitrd(k, ram_.low_size(), lk.end, initrd_size);
    if (!initrd_addr) {
      close(fd);
      throw std::runtime_error("guest memory too small: the kernel and a " + std::to_string(initrd_size >> 20) +
                               " MiB initrd do not fit in " + std::to_string(cfg_.memory_bytes >> 20) + " MiB");
    }
    // Straight from the file into guest RAM (no copy through JavaScript).
    uint8_t* dst = mem.Ptr(initrd_addr, initrd_size);
    uint64_t got = 0;
    while (got < initrd_size) {
      ssize_t n = pread(fd, dst + got, initrd_size - got, off_t(got));
      if (n <= 0) {
        close(fd);
        if (n == 0) errno = EIO;
        ThrowErrno("cannot read the initrd " + cfg_.initrd_path);
      }
      got += uint64_t(n);
    }
    close(fd);
  }
  if (!WriteBootParams(mem, kernel.data(), kernel.size(), k, cfg_.cmdline, initrd_addr, initrd_size,
                       BuildE820(cfg_.memory_bytes), &err) ||
      !WriteBootPageTablesAndGdt(mem, &err) || !WriteMpTable(mem, layout::kEbda, cfg_.vcpus, &err))
    throw std::runtime_error(err);
}

void Vm::SetupDevices() {
  uart_ = std::make_unique<Uart8250>([this] { IrqPulse(layout::kUartIrq); }, [this](uint8_t b) { ConsoleByte(b); });
  i8042_ = std::make_unique<I8042>([this] { RequestStop("reset", "the guest reset the machine"); });
  rtc_ = std::make_unique<CmosRtc>();
  pci_ = std::make_unique<PciBus>();
  auto add = [&](std::shared_ptr<VirtioDevice> dev, const std::string& name) {
    uint64_t bar = pci_->AllocateMmio(VirtioPciDevice::kBarSize);
    // A guest can fail a device, reset it and fail it again in a loop: only the first
    // few reports reach the host (each is an event for JS), then one saying so.
    auto reports = std::make_shared<std::atomic<uint32_t>>(0);
    auto pd = std::make_shared<VirtioPciDevice>(
        std::move(dev), ram_.memory(), bar, [this](uint64_t a, uint32_t d) { SignalMsi(a, d); },
        [this, name, reports](const std::string& message) {
          // (what the device read was zeros, or the kernel could not read it for the device)
          if (ram_.memory().lost() || MemoryFileCut()) RequestStop("error", RamLostMessage());
          uint32_t n = reports->fetch_add(1);
          if (n < kMaxDeviceErrorReports) {
            on_event_(VmEvent{VmEvent::Type::kDeviceError, name, message, {}});
          } else if (n == kMaxDeviceErrorReports) {
            on_event_(VmEvent{VmEvent::Type::kDeviceError, name, "it failed again; its further failures are not reported", {}});
          }
        });
    if (pci_->Add(pd) < 0) throw std::runtime_error("no free PCI slot");
    virtio_.push_back(std::move(pd));
  };
  if (!cfg_.vsock_path.empty()) {
    try {
      vsock_ = std::make_shared<VirtioVsock>(cfg_.vsock_cid, cfg_.vsock_path);
    } catch (const std::system_error& e) {
      throw std::runtime_error("cannot set up the vsock socket " + cfg_.vsock_path + ": " + e.what());
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string("vsock: ") + e.what());
    }
    vsock_->OnHostInput([this] { Wake(); });
    vsock_->BeforePass([this] { Unpack(); });
    add(vsock_, "virtio-vsock");
  }
  if (cfg_.rng) add(std::make_shared<VirtioRng>(), "virtio-rng");
}

void Vm::SetupVcpu(uint32_t index) {
  vcpus_.push_back(std::make_unique<Vcpu>());
  Vcpu& vc = *vcpus_.back();
  OpenVcpu(vc, index);

  // MSRs a BIOS would leave set: fast strings, and MTRRs enabled with
  // write-back as the default type (else the guest may map RAM uncached).
  const std::pair<uint32_t, uint64_t> msrs[] = {
      {0x174, 0}, {0x175, 0}, {0x176, 0},                                   // SYSENTER_CS/ESP/EIP
      {0xc0000081, 0}, {0xc0000082, 0}, {0xc0000083, 0}, {0xc0000084, 0},   // STAR/LSTAR/CSTAR/FMASK
      {0xc0000102, 0},                                                      // KERNEL_GS_BASE
      {0x1a0, 1},                                                           // MISC_ENABLE: fast strings
      {0x2ff, (1u << 11) | 6},                                              // MTRRdefType: E, WB
  };
  for (const auto& [index_msr, value] : msrs) {
    struct {
      FlexHeader hdr;
      kvm_msr_entry e;
    } m;
    std::memset(&m, 0, sizeof m);
    m.hdr.count = 1;
    m.e.index = index_msr;
    m.e.data = value;
    ioctl(vc.fd, kSetMsrs, &m);  // best effort: a CPU without one of them boots anyway
  }

  // LAPIC: LINT0 = ExtINT (the 8259 behind it), LINT1 = NMI, as a BIOS sets them.
  kvm_lapic_state lapic;
  Ioctl(vc.fd, KVM_GET_LAPIC, &lapic, "KVM_GET_LAPIC");
  auto lvt = [&](int off, uint32_t mode) {
    uint32_t r;
    std::memcpy(&r, lapic.regs + off, 4);
    r = (r & ~0x700u) | (mode << 8);
    std::memcpy(lapic.regs + off, &r, 4);
  };
  lvt(0x350, 7);
  lvt(0x360, 4);
  Ioctl(vc.fd, KVM_SET_LAPIC, &lapic, "KVM_SET_LAPIC");

  kvm_fpu fpu;
  std::memset(&fpu, 0, sizeof fpu);
  fpu.fcw = 0x37f;
  fpu.mxcsr = 0x1f80;
  Ioctl(vc.fd, KVM_SET_FPU, &fpu, "KVM_SET_FPU");

  // Application processors wait in KVM for INIT/SIPI from the BSP.
  if (index == 0) SetupBootRegisters(vc, entry_);
}

void Vm::OpenVcpu(Vcpu& vc, uint32_t index) {
  vc.fd = Ioctl(vm_fd_, KVM_CREATE_VCPU, index, "KVM_CREATE_VCPU");
  int size = Ioctl(kvm_fd_, KVM_GET_VCPU_MMAP_SIZE, 0ul, "KVM_GET_VCPU_MMAP_SIZE");
  void* run = mmap(nullptr, size_t(size), PROT_READ | PROT_WRITE, MAP_SHARED, vc.fd, 0);
  if (run == MAP_FAILED) ThrowErrno("mmap kvm_run");
  vc.run = static_cast<kvm_run*>(run);
  vc.run_size = size_t(size);

  // CPUID: what KVM supports (this keeps the KVM paravirt leaves 0x40000000..,
  // so the guest uses kvm-clock), with this vCPU's APIC id and a topology of
  // `vcpus` single-thread cores in one package.
  uint32_t n = 256;
  std::vector<uint8_t> buf;
  FlexHeader* cpuid = nullptr;
  for (;;) {
    buf.assign(sizeof(FlexHeader) + n * sizeof(kvm_cpuid_entry2), 0);
    cpuid = reinterpret_cast<FlexHeader*>(buf.data());
    cpuid->count = n;
    if (ioctl(kvm_fd_, kGetSupportedCpuid, cpuid) == 0) break;
    if (errno != E2BIG || n > 4096) ThrowErrno("KVM_GET_SUPPORTED_CPUID");
    n *= 2;
  }
  const uint32_t apic = index, cores = cfg_.vcpus, bits = CeilLog2(cfg_.vcpus);
  auto* entries = reinterpret_cast<kvm_cpuid_entry2*>(buf.data() + sizeof(FlexHeader));
  for (uint32_t i = 0; i < cpuid->count; i++) {
    kvm_cpuid_entry2& e = entries[i];
    switch (e.function) {
      case 1:
        e.ebx = (e.ebx & 0xffff) | (apic << 24) | ((cores > 255 ? 255 : cores) << 16);
        e.ecx |= 1u << 31;  // running under a hypervisor
        if (HostIsPvm()) e.ecx &= ~(1u << 13);  // CX16, see HostIsPvm()
        if (cores > 1) e.edx |= 1u << 28;
        break;
      case 0xb:
      case 0x1f:
        e.edx = apic;
        if (e.index == 0) {
          e.eax = 0, e.ebx = 1, e.ecx = (1u << 8) | 0;  // SMT level: 1 thread per core
        } else if (e.index == 1) {
          e.eax = bits, e.ebx = cores, e.ecx = (2u << 8) | 1;  // core level
        } else {
          e.eax = 0, e.ebx = 0, e.ecx = e.index;
        }
        break;
      case 0x80000008:
        e.ecx = (e.ecx & ~0xf0ffu) | (cores - 1) | (bits << 12);
        break;
      case 0x8000001e:
        e.eax = apic, e.ebx = apic & 0xff, e.ecx = 0;
        break;
      default:
        break;
    }
  }
  Ioctl(vc.fd, kSetCpuid2, cpuid, "KVM_SET_CPUID2");
}

void Vm::SetupBootRegisters(Vcpu& v, uint64_t entry) {
  kvm_sregs s;
  Ioctl(v.fd, KVM_GET_SREGS, &s, "KVM_GET_SREGS");
  auto seg = [](uint16_t sel, uint8_t type, bool code) {
    kvm_segment g;
    std::memset(&g, 0, sizeof g);
    g.base = 0;
    g.limit = 0xffffffff;
    g.selector = sel;
    g.type = type;
    g.present = 1;
    g.dpl = 0;
    g.db = code ? 0 : 1;
    g.s = 1;
    g.l = code ? 1 : 0;
    g.g = 1;
    return g;
  };
  s.cs = seg(kBootCs, 0xb, true);
  s.ds = s.es = s.fs = s.gs = s.ss = seg(kBootDs, 0x3, false);
  s.tr = seg(kBootTss, 0xb, false);
  s.tr.s = 0;
  s.tr.db = 0;
  s.gdt.base = layout::kGdt;
  s.gdt.limit = sizeof(kGdtEntries) - 1;
  s.idt.base = layout::kIdt;
  s.idt.limit = 7;
  // Long mode with the identity page tables; caches enabled (CD/NW clear: on
  // AMD the guest's CR0.CD is honoured and the decompressor would crawl).
  s.cr0 = 0x80000011;  // PG | ET | PE
  s.cr3 = layout::kPml4;
  s.cr4 = 0x20;        // PAE
  s.efer = 0x500;      // LME | LMA
  Ioctl(v.fd, KVM_SET_SREGS, &s, "KVM_SET_SREGS");

  kvm_regs r;
  std::memset(&r, 0, sizeof r);
  r.rflags = 2;
  r.rip = entry;
  r.rsp = r.rbp = layout::kBootStack;
  r.rsi = layout::kBootParams;
  Ioctl(v.fd, KVM_SET_REGS, &r, "KVM_SET_REGS");
}

void Vm::Start() {
  if (started_.exchange(true)) return;
  for (uint32_t i = 0; i < vcpus_.size(); i++) StartVcpuThread(i);
}

void Vm::StartVcpuThread(uint32_t index) {
  Vcpu& v = *vcpus_[index];
  v.thread = VmmThread([this, index] { VcpuLoop(index); });
  v.tid = v.thread.native_handle();
  v.in_thread = true;
}

void Vm::VcpuLoop(uint32_t index) {
  Vcpu& v = *vcpus_[index];
  {
    char name[16];
    snprintf(name, sizeof name, "vcpu%u", index);
    pthread_setname_np(pthread_self(), name);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, KickSignal());
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* lo = nullptr;
      size_t size = 0;
      if (pthread_attr_getstack(&attr, &lo, &size) == 0) {
        v.stack_size = size;
        v.stack_lo = reinterpret_cast<uintptr_t>(lo);
      }
      pthread_attr_destroy(&attr);
    }
  }
  kvm_run* run = v.run;
  while (true) {
    // Clear before checking the flags: a kick that sets it after the check
    // makes KVM_RUN return at once.
    __atomic_store_n(&run->immediate_exit, 0, __ATOMIC_SEQ_CST);
    if (stop_flag_.load()) break;
    if (ram_.memory().lost()) {  // (a device model or a snapshot met a file cut short: ram_guard.h)
      RequestStop("error", RamLostMessage());
      break;
    }
    {
      std::unique_lock<std::mutex> l(run_mu_);
      if (shelving_) break;  // (Shelve joins this thread; Unshelve starts another)
      if (pause_requested_ || holds_ || dozing_) {
        paused_count_++;
        run_cv_.notify_all();
        run_cv_.wait(l, [&] { return (!pause_requested_ && !holds_ && !dozing_) || shelving_ || stop_flag_.load(); });
        paused_count_--;
        continue;
      }
    }
    if (packed_flag_.load()) {
      Unpack();
      continue;  // (the checks above again: its writes may have met a file cut short)
    }
    // (EINVAL: the guest has no kvm-clock; nothing to tell it)
    if (v.clock_stopped.exchange(false)) ioctl(v.fd, KVM_KVMCLOCK_CTRL, 0);
    int r = ioctl(v.fd, KVM_RUN, 0);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        exits_[kExitIntr]++;
        continue;
      }
      // EFAULT: the guest touched RAM whose file was cut short or unreadable (KVM's own
      // access: no SIGBUS), or a host bug. Say which where the memory file shows it.
      const int err = errno;
      RequestStop("error", err == EFAULT && MemoryFileCut() ? RamLostMessage()
                                                           : std::string("KVM_RUN failed: ") + std::strerror(err));
      break;
    }
    switch (run->exit_reason) {
      // A device model that throws (a thread it could not start, memory it could not get)
      // ends this VM; an exception out of a vCPU thread would end the host process.
      case KVM_EXIT_IO:
        exits_[kExitIo]++;
        try {
          HandleIo(run);
        } catch (const std::exception& e) {
          RequestStop("error", std::string("a device failed on a port access of the guest: ") + e.what());
        }
        break;
      case KVM_EXIT_MMIO:
        exits_[kExitMmio]++;
        try {
          HandleMmio(run);
        } catch (const std::exception& e) {
          RequestStop("error", std::string("a device failed on an MMIO access of the guest: ") + e.what());
        }
        break;
      case KVM_EXIT_INTR:
        exits_[kExitIntr]++;
        break;
      case KVM_EXIT_HLT:
        // Only without an in-kernel LAPIC; a halted CPU with nothing to wake it.
        exits_[kExitHlt]++;
        RequestStop("halt", "vCPU " + std::to_string(index) + " halted");
        break;
      case KVM_EXIT_SHUTDOWN:
        exits_[kExitShutdown]++;
        RequestStop(panicked_ ? "panic" : "triple-fault",
                    "vCPU " + std::to_string(index) + " triple-faulted (KVM_EXIT_SHUTDOWN); " + VcpuRegs(v));
        break;
      case KVM_EXIT_SYSTEM_EVENT:
        exits_[kExitSystemEvent]++;
        RequestStop(run->system_event.type == KVM_SYSTEM_EVENT_RESET ? "reset" : "system-event",
                    "system event " + std::to_string(run->system_event.type));
        break;
      case KVM_EXIT_INTERNAL_ERROR: {
        exits_[kExitInternal]++;
        std::string m = "KVM internal error, suberror " + std::to_string(run->internal.suberror) + " (data";
        for (uint32_t i = 0; i < run->internal.ndata && i < 16; i++) {
          char b[24];
          snprintf(b, sizeof b, " %llx", (unsigned long long)run->internal.data[i]);
          m += b;
        }
        RequestStop("internal-error", m + "); " + VcpuRegs(v));
        break;
      }
      case KVM_EXIT_FAIL_ENTRY:
        exits_[kExitFailEntry]++;
        RequestStop("fail-entry", "VM entry failed, hardware reason " +
                                      std::to_string(run->fail_entry.hardware_entry_failure_reason) + "; " +
                                      VcpuRegs(v));
        break;
      default:
        exits_[kExitOther]++;
        RequestStop("error", "unexpected KVM exit " + std::to_string(run->exit_reason));
        break;
    }
  }
  std::lock_guard<std::mutex> l(run_mu_);
  exited_count_++;
  run_cv_.notify_all();
}

void Vm::HandleIo(kvm_run* run) {
  const uint32_t size = run->io.size;
  const uint16_t port = run->io.port;
  const bool out = run->io.direction == KVM_EXIT_IO_OUT;
  uint8_t* base = reinterpret_cast<uint8_t*>(run) + run->io.data_offset;
  std::lock_guard<std::mutex> l(io_mu_);
  for (uint32_t i = 0; i < run->io.count; i++) {
    uint8_t* d = base + uint64_t(i) * size;
    uint32_t val = 0;
    if (out) std::memcpy(&val, d, size <= 4 ? size : 4);
    uint32_t res = 0xffffffffu;  // an empty ISA bus reads as all ones
    if (port >= layout::kUartPort && port < layout::kUartPort + 8) {
      if (out) uart_->Write(uint8_t(port - layout::kUartPort), uint8_t(val));
      else res = uart_->Read(uint8_t(port - layout::kUartPort));
    } else if (port == 0x60 || port == 0x64) {
      if (out) i8042_->Write(port, uint8_t(val));
      else res = i8042_->Read(port);
    } else if (port == 0x70 || port == 0x71) {
      if (out) rtc_->Write(port, uint8_t(val));
      else res = rtc_->Read(port);
    } else if (port >= 0xcf8 && port <= 0xcff && (size == 1 || size == 2 || size == 4)) {
      if (out) pci_->IoWrite(port, size, val);
      else res = pci_->IoRead(port, size);
    }
    if (!out) std::memcpy(d, &res, size <= 4 ? size : 4);
  }
}

void Vm::HandleMmio(kvm_run* run) {
  uint32_t len = run->mmio.len;
  if (len > 8) len = 8;
  std::lock_guard<std::mutex> l(io_mu_);
  if (run->mmio.is_write) {
    pci_->MmioWrite(run->mmio.phys_addr, run->mmio.data, len);
  } else if (!pci_->MmioRead(run->mmio.phys_addr, run->mmio.data, len)) {
    std::memset(run->mmio.data, 0xff, len);
  }
}

void Vm::ConsoleByte(uint8_t b) {
  console_bytes_++;
  if (b == '\r') return;
  if (b != '\n') console_line_.push_back(char(b));
  if (b == '\n' || console_line_.size() >= 4096) {
    bool no_watch = false;
    // The kernel prints this before panic=-1 resets the machine; the reset is then reported as a panic.
    if (console_line_.find("Kernel panic - not syncing") != std::string::npos) panicked_ = true;
    if (console_line_.find("reboot: Power down") != std::string::npos ||
        console_line_.find("reboot: System halted") != std::string::npos) {
      std::lock_guard<std::mutex> l(halt_mu_);
      halt_hint_ = true;
      // The watch starts only now: a thread per VM that waits all its life costs a kernel stack
      // and more. Kill() sets stop_flag_ before it takes halt_mu_, so none starts after Kill
      // (stop_flag_ is read first: once it is set, Kill may be joining the thread outside the lock).
      if (!stop_flag_ && !halt_thread_.joinable()) {
        try {
          halt_thread_ = VmmThread([this] { HaltWatch(); });
        } catch (...) {
          no_watch = true;
        }
      }
      halt_cv_.notify_all();
    }
    on_event_(VmEvent{VmEvent::Type::kConsole, {}, {}, std::move(console_line_)});
    console_line_.clear();
    // No thread to confirm it: the guest said it powers off, and only its own VM ends.
    if (no_watch) RequestStop("poweroff", "the guest powered off (said on its console; no thread to confirm the halt)");
  }
}

void Vm::IrqPulse(uint32_t irq) {
  Wake();  // (an interrupt for a dozing guest: it must run to take it)
  kvm_irq_level l;
  l.irq = irq;
  l.level = 1;
  ioctl(vm_fd_, KVM_IRQ_LINE, &l);
  l.level = 0;
  ioctl(vm_fd_, KVM_IRQ_LINE, &l);
}

void Vm::SignalMsi(uint64_t address, uint32_t data) {
  Wake();
  kvm_msi m;
  std::memset(&m, 0, sizeof m);
  m.address_lo = uint32_t(address);
  m.address_hi = uint32_t(address >> 32);
  m.data = data;
  ioctl(vm_fd_, KVM_SIGNAL_MSI, &m);
}

bool Vm::MemoryFileCut() const {
  struct stat st;
  return origin_ && origin_->memory_fd && fstat(origin_->memory_fd->get(), &st) == 0 &&
         uint64_t(st.st_size) < origin_->memory_bytes;
}

std::string Vm::RamLostMessage() const {
  std::string from = origin_ ? "the memory file of " + origin_->what + " (" + origin_->memory_path + ")" : "its memory file";
  if (MemoryFileCut()) from += ", now shorter than the guest's RAM,";
  return "guest RAM lost: " + from + " or a diff layer over it was cut short or could not be read while this VM "
         "mapped it (a template's files must not change while its children run); the VM is stopped";
}

void Vm::RequestStop(const std::string& reason, const std::string& message) {
  bool expected = false;
  if (!stopped_.compare_exchange_strong(expected, true)) return;
  stop_flag_ = true;
  std::string r = reason;
  if (r == "reset" && panicked_) r = "panic";
  // A guest running on RAM that was lost (zeros) stops for that, whatever it did next.
  const bool lost = ram_.memory().lost();
  on_event_(VmEvent{VmEvent::Type::kStopped, lost ? "error" : r, lost ? RamLostMessage() : message, {}});
  KickAll();
}

void Vm::KickAll() {
  // (under run_mu_: Shelve ends the threads and unmaps kvm_run after it clears in_thread under it)
  std::lock_guard<std::mutex> l(run_mu_);
  run_cv_.notify_all();
  for (auto& v : vcpus_) {
    if (!v->in_thread) continue;
    __atomic_store_n(&v->run->immediate_exit, 1, __ATOMIC_SEQ_CST);
    pthread_kill(v->tid, KickSignal());
  }
}

void Vm::Pause() {
  if (!started_ || stop_flag_) return;
  {
    std::lock_guard<std::mutex> l(run_mu_);
    pause_requested_ = true;
  }
  WaitStopped();
  Unpack();  // (the owner may read or save its RAM now)
}

void Vm::Resume() {
  std::lock_guard<std::mutex> l(run_mu_);
  pause_requested_ = false;
  run_cv_.notify_all();
}

bool Vm::Doze() {
  if (!started_ || stop_flag_) return false;
  {
    std::lock_guard<std::mutex> l(run_mu_);
    if (dozing_) return true;
    for (auto& v : vcpus_) v->clock_stopped = true;
    dozing_ = true;
    dozes_++;
    doze_t0_ = std::chrono::steady_clock::now();
  }
  WaitStopped();
  return !stop_flag_;
}

void Vm::Wake() {
  if (!dozing_.load()) return;
  Unpack();  // (a shelved VM has no vCPU thread to do it, nor a KVM VM to take an interrupt)
  std::lock_guard<std::mutex> l(run_mu_);
  if (!dozing_) return;
  dozing_ = false;
  dozed_ += std::chrono::steady_clock::now() - doze_t0_;
  run_cv_.notify_all();
}

void Vm::Hold() {
  {
    std::lock_guard<std::mutex> l(run_mu_);
    holds_++;
  }
  if (started_ && !stop_flag_) WaitStopped();
  Unpack();  // (a holder reads or writes RAM)
}

snapshot::PackResult Vm::Pack(bool shelve) {
  snapshot::PackResult r;
  if (!origin_ || !started_ || stop_flag_ || !dozing_ || packed_flag_) return r;
  Hold();
  struct Let {
    Vm* vm;
    ~Let() { vm->Release(); }
  } let{this};
  // First the vsock loop's pass for what the guest asked before it stopped (a queue kick on its
  // way): run after the pack, that pass would write every page back (BeforePass) at once.
  if (vsock_ && !vsock_->Sync(1000)) return r;
  // The vsock loop between two of its passes, the other writer (and reader) of guest RAM; its
  // next pass unpacks first (BeforePass). Taken after the hold: a vCPU may wait for that loop.
  std::unique_lock<std::mutex> loop;
  if (vsock_) loop = vsock_->HoldLoop();
  std::lock_guard<std::mutex> pl(pack_mu_);
  {
    std::lock_guard<std::mutex> l(run_mu_);
    if (!dozing_ || stop_flag_ || packed_) return r;  // (woken meanwhile)
  }
  try {
    snapshot::PackPages(*this, packed_, r);
  } catch (...) {
    packed_flag_ = packed_ != nullptr;  // (what was dropped is in the store)
    throw;
  }
  if (packed_) {
    packed_flag_ = true;
    packed_pages_ = r.packed_pages;
    packed_bytes_ = r.host_bytes;
    packs_++;
    if (r.kept_pages == 0) r.ram_tables_dropped = DropRamTables();
    if (r.ram_tables_dropped && shelve) r.shelved = Shelve();
    // Its vsock loop's thread may end too until the host or the guest wants something (after this
    // hold: the loop parks at its next wake, between two passes).
    if (r.shelved && vsock_) vsock_->RequestPark();
  }
  return r;
}

void Vm::Unpack() {
  if (!packed_flag_.load()) return;
  std::lock_guard<std::mutex> l(pack_mu_);
  if (!packed_) return;
  const auto t0 = std::chrono::steady_clock::now();
  bool mapped = true;
  if (ram_reserved_) {
    ram_reserved_ = false;
    try {
      MapRamAgain();
    } catch (const std::exception& e) {
      // Zeros rather than an inaccessible range: a device may still read its rings before it stops.
      mmap(ram_.host(), ram_.size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      RequestStop("error", std::string("its RAM could not be mapped again as it woke: ") + e.what());
      mapped = false;
    }
  }
  const bool ok = !mapped || (ram_.host() && packed_->Apply(ram_.host(), ram_.size() / 4096));
  if (shelf_) {
    Unshelve();  // (its memslots too)
    if (vsock_) vsock_->CancelPark();  // (awake again before its vsock loop parked: it keeps its thread)
  } else {
    const bool slots_ok = !memslots_removed_ || AddMemslots();
    memslots_removed_ = false;
    if (!slots_ok) RequestStop("error", std::string("KVM_SET_USER_MEMORY_REGION failed as the VM woke: ") + std::strerror(errno));
  }
  packed_.reset();
  packed_flag_ = false;
  packed_pages_ = 0;
  packed_bytes_ = 0;
  unpacks_++;
  last_unpack_ns_ = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  if (!ok) RequestStop("error", "the VM's packed pages did not fit its RAM (a host bug); the VM is stopped");
}

void Vm::Release() {
  std::lock_guard<std::mutex> l(run_mu_);
  if (holds_) holds_--;
  run_cv_.notify_all();
}

HeldStill::HeldStill(Vm& vm) : vm_(vm), vsock_(vm.vsock()) {
  if (vsock_) vsock_->Pause();
  t0_ = std::chrono::steady_clock::now();
  vm_.Hold();
}

uint64_t HeldStill::Let() {
  if (!held_) return 0;
  held_ = false;
  vm_.Release();
  const auto held = std::chrono::steady_clock::now() - t0_;
  if (vsock_ && !keep_vsock_) vsock_->Resume();
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(held).count());
}

void Vm::WaitStopped() {
  KickAll();
  std::unique_lock<std::mutex> l(run_mu_);
  run_cv_.wait(l, [&] { return paused_count_ + exited_count_ >= vcpus_.size(); });
}

void Vm::HaltWatch() {
  pthread_setname_np(pthread_self(), "halt-watch");  // (else it has its creator's name, a vCPU's)
  std::unique_lock<std::mutex> l(halt_mu_);
  halt_cv_.wait(l, [&] { return halt_hint_ || stop_flag_.load(); });
  // Up to ~2 s for every vCPU to reach its final halt after the message.
  for (int attempt = 0; attempt < 100 && !stop_flag_; attempt++) {
    if (halt_cv_.wait_for(l, std::chrono::milliseconds(20), [&] { return stop_flag_.load(); })) return;
    l.unlock();
    Hold();
    bool all_halted = !stop_flag_;
    {
      std::lock_guard<std::mutex> pl(pack_mu_);  // (the vCPU files: a pack on another thread may shelve the VM)
      for (auto& v : vcpus_) {
        kvm_mp_state mp;
        kvm_regs r;
        if (v->fd < 0 || ioctl(v->fd, KVM_GET_MP_STATE, &mp) != 0 || ioctl(v->fd, KVM_GET_REGS, &r) != 0 ||
            mp.mp_state != KVM_MP_STATE_HALTED || (r.rflags & 0x200)) {
          all_halted = false;
          break;
        }
      }
    }
    Release();
    if (all_halted) {
      RequestStop("poweroff", "the guest powered off (all vCPUs halted with interrupts disabled)");
      return;
    }
    l.lock();
  }
}

void Vm::Kill() {
  if (killed_.exchange(true)) return;
  stopped_ = true;
  stop_flag_ = true;
  KickAll();
  {
    std::lock_guard<std::mutex> l(halt_mu_);
    halt_cv_.notify_all();
  }
  if (halt_thread_.joinable()) halt_thread_.join();
  // (an Unshelve under way on another thread ends first; after it, none starts a vCPU thread)
  { std::lock_guard<std::mutex> l(pack_mu_); }
  for (auto& v : vcpus_) {
    if (v->thread.joinable()) v->thread.join();
    v->in_thread = false;
  }
  // Devices first (the vsock thread writes guest memory), then KVM, then RAM.
  for (auto& d : virtio_) d->Reset();
  virtio_.clear();
  vsock_.reset();
  pci_.reset();
  for (auto& v : vcpus_) {
    if (v->run) munmap(v->run, v->run_size);
    if (v->fd >= 0) close(v->fd);
  }
  vcpus_.clear();
  if (vm_fd_ >= 0) close(vm_fd_);
  if (kvm_fd_ >= 0) close(kvm_fd_);
  vm_fd_ = kvm_fd_ = -1;
  {
    std::lock_guard<std::mutex> l(pack_mu_);
    packed_.reset();
    shelf_.reset();
    kvm_stats_.reset();  // (its file holds the KVM VM too)
    packed_flag_ = false;
    packed_pages_ = packed_bytes_ = 0;
  }
  ram_.Release();
  if (!console_line_.empty()) {
    on_event_(VmEvent{VmEvent::Type::kConsole, {}, {}, std::move(console_line_)});
    console_line_.clear();
  }
}

// One line of registers, read by the vCPU's own thread (or while it is paused).
std::string Vm::VcpuRegs(const Vcpu& v) {
  kvm_regs r;
  kvm_sregs s;
  if (ioctl(v.fd, KVM_GET_REGS, &r) != 0 || ioctl(v.fd, KVM_GET_SREGS, &s) != 0) return "registers unavailable";
  char line[320];
  snprintf(line, sizeof line,
           "rip=%llx rsp=%llx rax=%llx rcx=%llx rdx=%llx rsi=%llx rdi=%llx rflags=%llx cr0=%llx cr2=%llx cr3=%llx "
           "cr4=%llx efer=%llx cs=%x",
           (unsigned long long)r.rip, (unsigned long long)r.rsp, (unsigned long long)r.rax,
           (unsigned long long)r.rcx, (unsigned long long)r.rdx, (unsigned long long)r.rsi,
           (unsigned long long)r.rdi, (unsigned long long)r.rflags, (unsigned long long)s.cr0,
           (unsigned long long)s.cr2, (unsigned long long)s.cr3, (unsigned long long)s.cr4,
           (unsigned long long)s.efer, s.cs.selector);
  return line;
}

std::string Vm::DebugState() {
  if (!started_ || killed_) return "";
  Hold();
  std::string out;
  char line[256];
  for (size_t i = 0; i < vcpus_.size(); i++) {
    kvm_regs r;
    kvm_sregs s;
    kvm_mp_state mp;
    if (ioctl(vcpus_[i]->fd, KVM_GET_REGS, &r) != 0 || ioctl(vcpus_[i]->fd, KVM_GET_SREGS, &s) != 0) continue;
    if (ioctl(vcpus_[i]->fd, KVM_GET_MP_STATE, &mp) != 0) mp.mp_state = 99;
    snprintf(line, sizeof line,
             "vcpu%zu: rip=%llx rsp=%llx rflags=%llx cr0=%llx cr3=%llx cr4=%llx efer=%llx cs=%x mp_state=%u\n", i,
             (unsigned long long)r.rip, (unsigned long long)r.rsp, (unsigned long long)r.rflags,
             (unsigned long long)s.cr0, (unsigned long long)s.cr3, (unsigned long long)s.cr4,
             (unsigned long long)s.efer, s.cs.selector, mp.mp_state);
    out += line;
  }
  Release();
  return out;
}

namespace {
// Resident bytes of [p, p+len) (page-aligned p), 0 if it is not mapped.
uint64_t ResidentOf(uintptr_t p, size_t len) {
  if (!p || !len) return 0;
  const size_t pages = (len + 4095) / 4096;
  std::vector<unsigned char> vec(pages);
  if (mincore(reinterpret_cast<void*>(p), len, vec.data()) != 0) return 0;
  uint64_t n = 0;
  for (unsigned char c : vec) n += c & 1;
  return n * 4096;
}
}  // namespace

Vm::Stats Vm::GetStats() {
  Stats s;
  s.memory_bytes = cfg_.memory_bytes;
  s.resident_bytes = ram_.ResidentBytes();
  uint64_t stacks = 0, runs = 0, npt = 0;
  // (under pack_mu_: a shelve or unshelve on another thread changes the vCPUs and the KVM VM)
  std::lock_guard<std::mutex> pl(pack_mu_);
  for (const auto& v : vcpus_) {
    stacks += ResidentOf(v->stack_lo.load(), v->stack_size.load());
    if (v->run) runs += ResidentOf(reinterpret_cast<uintptr_t>(v->run), v->run_size);
  }
  if (!kvm_stats_ && vm_fd_ >= 0) kvm_stats_ = std::make_unique<KvmStats>(ioctl(vm_fd_, KVM_GET_STATS_FD, 0));
  if (kvm_stats_ && kvm_stats_->ok()) {
    // Leaf entries per level, then the fewest table pages that hold them.
    int64_t p4k = kvm_stats_->Read("pages_4k"), p2m = kvm_stats_->Read("pages_2m"), p1g = kvm_stats_->Read("pages_1g");
    if (p4k >= 0 && p2m >= 0 && p1g >= 0) {
      auto tables = [](uint64_t entries) { return (entries + 511) / 512; };
      uint64_t l1 = tables(uint64_t(p4k)), l2 = tables(l1 + uint64_t(p2m)), l3 = tables(l2 + uint64_t(p1g));
      npt = (l1 + l2 + l3 + (l3 ? 1 : 0)) * 4096;
    }
  }
  static const char* kNames[kExitKinds] = {"exits_io", "exits_mmio", "exits_intr", "exits_hlt", "exits_shutdown",
                                           "exits_system_event", "exits_internal_error", "exits_fail_entry",
                                           "exits_other"};
  for (int i = 0; i < kExitKinds; i++) s.counters.emplace_back(kNames[i], exits_[i].load());
  s.counters.emplace_back("console_bytes", console_bytes_.load());
  {
    std::lock_guard<std::mutex> l(run_mu_);
    auto dozed = dozed_ + (dozing_ ? std::chrono::steady_clock::now() - doze_t0_ : std::chrono::steady_clock::duration{});
    s.counters.emplace_back("dozing", dozing_ ? 1 : 0);
    s.counters.emplace_back("dozes", dozes_);
    s.counters.emplace_back("dozed_ms", uint64_t(std::chrono::duration_cast<std::chrono::milliseconds>(dozed).count()));
  }
  s.counters.emplace_back("packed_pages", packed_pages_.load());
  s.counters.emplace_back("packed_bytes", packed_bytes_.load());
  s.counters.emplace_back("packs", packs_.load());
  s.counters.emplace_back("unpacks", unpacks_.load());
  s.counters.emplace_back("last_unpack_us", last_unpack_ns_.load() / 1000);
  s.counters.emplace_back("shelved", shelf_ ? 1 : 0);
  s.counters.emplace_back("shelf_bytes", shelf_ ? shelf_->state.size() + shelf_->tsc_khz.size() * sizeof(uint64_t) : 0);
  s.counters.emplace_back("shelves", shelves_.load());
  s.counters.emplace_back("last_unshelve_us", last_unshelve_ns_.load() / 1000);
  uint64_t irqs = 0;
  for (const auto& d : virtio_) irqs += d->interrupts_sent();
  s.counters.emplace_back("virtio_interrupts", irqs);
  if (vsock_) {
    VirtioVsock::Stats v = vsock_->stats();
    s.counters.emplace_back("vsock_tx_packets", v.tx_packets);
    s.counters.emplace_back("vsock_rx_packets", v.rx_packets);
    s.counters.emplace_back("vsock_bad_packets", v.bad_packets);
    s.counters.emplace_back("vsock_connections", v.connections);
    s.counters.emplace_back("vsock_parked", v.parked);
    s.counters.emplace_back("vsock_parks", v.parks);
    s.counters.emplace_back("vsock_park_refusals", v.park_refusals);
  }
  if (const snapshot::PatternBacking* pb = pattern()) {
    s.counters.emplace_back("pattern_maps", pb->maps());
    s.counters.emplace_back("pattern_maps_left", pb->MapsLeft());
  }
  s.counters.emplace_back("host_vcpu_stack_bytes", stacks);
  s.counters.emplace_back("host_kvm_run_bytes", runs);
  s.counters.emplace_back("host_npt_min_bytes", npt);
  return s;
}

}  // namespace forkling::vmm
