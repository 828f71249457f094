// Vm's snapshot members (declared in vm.h) and the template/branch helpers.
#include "vmm/snapshot/vm_snapshot.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "vmm/snapshot/checksum.h"
#include "vmm/snapshot/diff_layer.h"
#include "vmm/snapshot/kvm_state.h"
#include "vmm/snapshot/packed_pages.h"  // (Vm owns a PackedPages and a Shelf: its constructors here destroy them on failure)
#include "vmm/snapshot/vm_shelf.h"
#include "vmm/layout.h"
#include "vmm/snapshot/pagemap.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/virtio_pci.h"
#include "vmm/virtio_rng.h"
#include "vmm/virtio_vsock.h"

namespace forkling::vmm {
namespace {

using namespace snapshot;

constexpr uint32_t kTagMeta = Tag("META"), kTagMemory = Tag("MEMF"), kTagUart = Tag("UART"),
                   kTagI8042 = Tag("I842"), kTagRtc = Tag("RTC_"), kTagPciConfig = Tag("PCIC"),
                   kTagTransport = Tag("VPCI"), kTagVsock = Tag("VSCK"), kTagRng = Tag("VRNG");

struct Meta {
  uint32_t version;
  uint32_t vcpus;
  uint64_t memory_bytes;
  uint32_t virtio_count;
  uint8_t has_vsock, has_rng, pad[2];
};

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

template <class T>
Section Pod(uint32_t tag, uint32_t index, const T& v) {
  ByteWriter w;
  w.Put(v);
  return Section{tag, index, std::move(w.bytes())};
}

template <class T>
T GetPod(const std::vector<Section>& s, uint32_t tag, uint32_t index, const std::string& what, const char* name) {
  const Section* sec = FindSection(s, tag, index);
  if (!sec) throw CorruptError(what + " is corrupt: state file has no " + name + " section");
  ByteReader r(sec->data, what + " is corrupt: " + name);
  T v = r.Get<T>();
  r.ExpectDone();
  return v;
}

Section EncodeTransport(uint32_t index, const VirtioPciDevice::TransportState& t) {
  ByteWriter w;
  w.Put(t.device_feature_select);
  w.Put(t.driver_feature_select);
  w.Put(t.driver_features);
  w.Put(t.queue_select);
  w.Put(t.status);
  w.Put(uint8_t(t.active));
  w.Put(uint8_t(t.needs_reset));
  w.Put(t.config_vector);
  w.Put(t.isr);
  w.PutBlob(t.queues.data(), t.queues.size() * sizeof(QueueConfig));
  w.PutBlob(t.vectors.data(), t.vectors.size() * 2);
  w.PutBlob(t.msix_table.data(), t.msix_table.size() * 4);
  w.PutBlob(t.msix_pending.data(), t.msix_pending.size());
  return Section{kTagTransport, index, std::move(w.bytes())};
}

VirtioPciDevice::TransportState DecodeTransport(const Section& s, const std::string& what) {
  ByteReader r(s.data, what + " is corrupt: virtio transport " + std::to_string(s.index));
  VirtioPciDevice::TransportState t;
  t.device_feature_select = r.Get<uint32_t>();
  t.driver_feature_select = r.Get<uint32_t>();
  r.GetBytes(t.driver_features, sizeof t.driver_features);
  t.queue_select = r.Get<uint16_t>();
  t.status = r.Get<uint8_t>();
  t.active = r.Get<uint8_t>() != 0;
  t.needs_reset = r.Get<uint8_t>() != 0;
  t.config_vector = r.Get<uint16_t>();
  t.isr = r.Get<uint8_t>();
  auto q = r.GetBlob(64 * sizeof(QueueConfig));
  auto v = r.GetBlob(64 * 2);
  auto m = r.GetBlob(65 * 16);
  auto p = r.GetBlob(65);
  r.ExpectDone();
  if (q.size() % sizeof(QueueConfig) || v.size() % 2 || m.size() % 4)
    throw CorruptError(what + " is corrupt: virtio transport " + std::to_string(s.index) + " has ragged fields");
  t.queues.resize(q.size() / sizeof(QueueConfig));
  std::memcpy(t.queues.data(), q.data(), q.size());
  for (const QueueConfig& c : t.queues) CheckFlag(c.ready, what + " is corrupt: virtio transport " + std::to_string(s.index));
  t.vectors.resize(v.size() / 2);
  std::memcpy(t.vectors.data(), v.data(), v.size());
  t.msix_table.resize(m.size() / 4);
  std::memcpy(t.msix_table.data(), m.data(), m.size());
  t.msix_pending.assign(p.begin(), p.end());
  return t;
}

}  // namespace

std::vector<Section> Vm::SaveState() {
  std::vector<Section> out;
  // The vsock loop writes guest memory and ring positions: hold it still.
  if (vsock_) vsock_->Pause();
  try {
    Meta meta{};
    meta.version = kSnapshotVersion;
    meta.vcpus = cfg_.vcpus;
    meta.memory_bytes = cfg_.memory_bytes;
    meta.virtio_count = uint32_t(virtio_.size());
    meta.has_vsock = vsock_ != nullptr;
    meta.has_rng = cfg_.rng;
    out.push_back(Pod(kTagMeta, 0, meta));
    CaptureKvmSections(kvm_fd_, vm_fd_, VcpuFds(), out);
    {
      std::lock_guard<std::mutex> l(io_mu_);
      out.push_back(Pod(kTagUart, 0, uart_->SaveState()));
      out.push_back(Pod(kTagI8042, 0, i8042_->SaveState()));
      out.push_back(Pod(kTagRtc, 0, rtc_->SaveState()));
      for (uint32_t i = 0; i < virtio_.size(); i++) {
        uint8_t cfg[256];
        virtio_[i]->SaveConfig(cfg);
        ByteWriter w;
        w.PutBytes(cfg, 256);
        out.push_back(Section{kTagPciConfig, i, std::move(w.bytes())});
        out.push_back(EncodeTransport(i, virtio_[i]->SaveTransport()));
        VirtioDevice* d = virtio_[i]->device();
        if (d == vsock_.get()) out.push_back(Pod(kTagVsock, 0, vsock_->SaveState()));
        else if (auto* rng = dynamic_cast<VirtioRng*>(d)) out.push_back(Pod(kTagRng, 0, rng->SaveState()));
      }
    }
  } catch (...) {
    if (vsock_) vsock_->Resume();
    throw;
  }
  if (vsock_) vsock_->Resume();
  return out;
}

void Vm::SetPattern(std::shared_ptr<const DiffLayer> layer) {
  if (!origin_ || !ram_.host() || ram_.shared() || !origin_->layers.empty())
    throw std::runtime_error("only a VM restored from a template (not a branch) can map a pattern");
  if (pattern_) throw std::runtime_error("this VM has a pattern already");
  if (!layer || layer->ram_size() != ram_.size()) throw std::invalid_argument("the pattern is of a VM with another RAM size");
  std::lock_guard<std::mutex> l(pack_mu_);  // (Unpack maps its stretches again, on any thread)
  pattern_ = std::make_shared<PatternBacking>(std::move(layer));
}

void Vm::RestoreRam(const RestoreSpec& spec) {
  if (!spec.memory_fd) throw std::logic_error(spec.what + ": the snapshot has no open memory file");
  ram_ = GuestRam::AdoptPrivate(MapLayered(spec.memory_fd->get(), spec.memory_bytes, spec.layers), spec.memory_bytes);
}

bool Vm::DropRamTables() {
  // (a private page would go with the old mapping: Pack calls this only once it dropped them all)
  if (!origin_ || !origin_->memory_fd || !ram_.host() || ram_.shared() || memslots_removed_) return false;
  const GuestMemory& m = ram_.memory();
  for (size_t i = 0; i < m.region_count(); i++) {
    kvm_userspace_memory_region reg;
    std::memset(&reg, 0, sizeof reg);
    reg.slot = uint32_t(i);  // memory_size 0: removed
    if (ioctl(vm_fd_, KVM_SET_USER_MEMORY_REGION, &reg) != 0) {
      if (!AddMemslots()) RequestStop("error", "KVM_SET_USER_MEMORY_REGION failed while it dozed");
      return false;
    }
  }
  memslots_removed_ = true;
  // In place: the old mapping, and the page tables that map it, go in the same call (no gap
  // another thread could map into). Until it wakes, one inaccessible mapping holds the range: its
  // layers and pattern stretches took a mapping each (VMAs, kernel memory), and nothing reads
  // RAM before Unpack maps them again (MapRamAgain).
  if (mmap(ram_.host(), ram_.size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
    try {
      MapRamAgain();  // (as it was, with new page tables)
    } catch (const std::exception& e) {
      RequestStop("error", std::string("its RAM could not be mapped again while it dozed: ") + e.what());
    }
    return false;
  }
  ram_reserved_ = true;
  return true;
}

void Vm::MapRamAgain() {
  MapLayered(origin_->memory_fd->get(), ram_.size(), origin_->layers, ram_.host());
  madvise(ram_.host(), ram_.size(), MADV_DONTDUMP);
  if (pattern_ && !pattern_->MapAgain(ram_.host())) throw std::runtime_error("mmap of its pattern failed");
}

SharedFd::~SharedFd() {
  if (fd_ >= 0) close(fd_);
}

void Vm::RestoreState(const RestoreSpec& spec) {
  const std::string& what = spec.what;
  const auto& s = spec.state;
  Meta meta = GetPod<Meta>(s, kTagMeta, 0, what, "META");
  if (meta.version != kSnapshotVersion || meta.vcpus != cfg_.vcpus || meta.memory_bytes != cfg_.memory_bytes ||
      meta.virtio_count != virtio_.size() || bool(meta.has_vsock) != (vsock_ != nullptr) ||
      bool(meta.has_rng) != cfg_.rng)
    throw std::runtime_error(what + ": the snapshot's machine (memory, vCPUs, devices) differs from this VM's");
  const KvmState k = DecodeKvmSections(s, uint32_t(vcpus_.size()), what);
  RestoreVm(vm_fd_, k.vm);
  for (uint32_t i = 0; i < vcpus_.size(); i++) RestoreVcpu(vm_fd_, vcpus_[i]->fd, k.vcpus[i]);
  std::lock_guard<std::mutex> l(io_mu_);
  uart_->RestoreState(GetPod<Uart8250::State>(s, kTagUart, 0, what, "UART"));
  i8042_->RestoreState(GetPod<I8042::State>(s, kTagI8042, 0, what, "i8042"));
  rtc_->RestoreState(GetPod<CmosRtc::State>(s, kTagRtc, 0, what, "RTC"));
  for (uint32_t i = 0; i < virtio_.size(); i++) {
    const Section* c = FindSection(s, kTagPciConfig, i);
    const Section* t = FindSection(s, kTagTransport, i);
    if (!c || c->data.size() != 256 || !t)
      throw CorruptError(what + " is corrupt: virtio device " + std::to_string(i) + " state is missing");
    virtio_[i]->RestoreConfig(c->data.data());
    VirtioDevice* d = virtio_[i]->device();
    std::string err = virtio_[i]->RestoreTransport(
        DecodeTransport(*t, what), [&](const GuestMemory& mem, VirtioDevice::NotifyGuest notify) {
          if (d == vsock_.get()) {
            VirtioVsock::State vs = GetPod<VirtioVsock::State>(s, kTagVsock, 0, what, "vsock");
            CheckFlag(vs.active, what + " is corrupt: vsock");
            for (const Virtqueue::State& q : vs.queues) CheckFlag(q.config.ready, what + " is corrupt: vsock");
            // The guest keeps its CID; this device is configured with the same one.
            vsock_->RestoreState(mem, vs, std::move(notify));
          } else if (auto* rng = dynamic_cast<VirtioRng*>(d)) {
            VirtioRng::State rs = GetPod<VirtioRng::State>(s, kTagRng, 0, what, "rng");
            CheckFlag(rs.active, what + " is corrupt: rng");
            CheckFlag(rs.queue.config.ready, what + " is corrupt: rng");
            rng->RestoreState(mem, rs, std::move(notify));
          }
        });
    if (!err.empty()) throw std::runtime_error(what + ": " + err);
    if (d->failed()) throw std::runtime_error(what + ": restoring a virtio device failed: " + d->failure());
  }
}

void Vm::SetDirtyLogging(bool on) {
  const GuestMemory& m = ram_.memory();
  for (size_t i = 0; i < m.region_count(); i++) {
    const GuestRegion& r = m.region(i);
    kvm_userspace_memory_region reg;
    std::memset(&reg, 0, sizeof reg);
    reg.slot = uint32_t(i);  // as SetupMemory numbers them
    reg.flags = on ? KVM_MEM_LOG_DIRTY_PAGES : 0;
    reg.guest_phys_addr = r.gpa;
    reg.memory_size = r.size;
    reg.userspace_addr = reinterpret_cast<uint64_t>(r.host);
    if (ioctl(vm_fd_, KVM_SET_USER_MEMORY_REGION, &reg) != 0)
      throw std::system_error(errno, std::generic_category(), "KVM_SET_USER_MEMORY_REGION (dirty logging)");
  }
}

std::vector<uint64_t> Vm::TakeDirtyPages() {
  std::vector<uint64_t> out;
  const GuestMemory& m = ram_.memory();
  for (size_t i = 0; i < m.region_count(); i++) {
    const GuestRegion& r = m.region(i);
    const uint64_t pages = r.size / kPageSize;
    std::vector<uint64_t> bitmap((pages + 63) / 64, 0);
    kvm_dirty_log log;
    std::memset(&log, 0, sizeof log);
    log.slot = uint32_t(i);
    log.dirty_bitmap = bitmap.data();
    if (ioctl(vm_fd_, KVM_GET_DIRTY_LOG, &log) != 0)
      throw std::system_error(errno, std::generic_category(), "KVM_GET_DIRTY_LOG");
    const uint64_t first = uint64_t(r.host - ram_.host()) / kPageSize;
    for (uint64_t w = 0; w < bitmap.size(); w++)
      for (uint64_t bits = bitmap[w]; bits; bits &= bits - 1) out.push_back(first + w * 64 + uint64_t(__builtin_ctzll(bits)));
  }
  return out;
}

std::vector<uint64_t> Vm::RngWritablePages() {
  std::vector<uint64_t> out;
  const GuestMemory& m = ram_.memory();
  auto add = [&](uint64_t gpa, uint64_t len) {
    // Guest-controlled addresses: only ranges inside RAM, bounded.
    len = std::min<uint64_t>(len, 64 * 1024);
    if (len == 0) len = 1;
    uint8_t* p = m.Ptr(gpa, len);
    if (!p) return;
    for (uint64_t a = uint64_t(p - ram_.host()) / kPageSize; a <= uint64_t(p + len - 1 - ram_.host()) / kPageSize; a++)
      out.push_back(a);
  };
  for (const auto& pd : virtio_) {
    auto* rng = dynamic_cast<VirtioRng*>(pd->device());
    if (!rng) continue;
    VirtioRng::State st = rng->SaveState();
    if (!st.active || !st.queue.config.ready) continue;
    const QueueConfig& q = st.queue.config;
    const uint64_t n = std::min<uint64_t>(q.size, 1024);
    add(q.desc, 16 * n);
    add(q.driver, 6 + 2 * n);
    add(q.device, 6 + 8 * n);
    for (uint64_t i = 0; i < n; i++) {
      uint64_t addr = 0;
      uint32_t len = 0;
      uint16_t flags = 0;
      if (!m.Read(q.desc + 16 * i, &addr) || !m.Read(q.desc + 16 * i + 8, &len) || !m.Read(q.desc + 16 * i + 12, &flags))
        continue;
      if (!(flags & kVirtqDescFIndirect)) {
        add(addr, len);
        continue;
      }
      // An indirect table: the device fills at most the first kMaxBytesPerRequest of its buffers.
      uint64_t covered = 0;
      for (uint64_t j = 0; j < std::min<uint64_t>(len / 16, kMaxIndirectDescriptors) && covered < VirtioRng::kMaxBytesPerRequest; j++) {
        uint64_t a = 0;
        uint32_t l = 0;
        if (!m.Read(addr + 16 * j, &a) || !m.Read(addr + 16 * j + 8, &l)) break;
        add(a, std::min<uint64_t>(l, VirtioRng::kMaxBytesPerRequest - covered));
        covered += l;
      }
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace snapshot {

TemplateWritten WriteTemplate(Vm& vm, const std::string& dir) {
  TemplateWritten r;
  auto t0 = std::chrono::steady_clock::now();
  vm.Unpack();  // (the owner's Pause did, for a VM paused as it must be: this for one that was not)
  std::vector<Section> sections = vm.SaveState();
  auto t1 = std::chrono::steady_clock::now();
  const GuestRam& ram = vm.ram();
  r.memory = WriteMemoryFile(ram.host(), ram.size(), ram.shared() ? ram.fd() : -1, dir + "/memory.bin");
  if (ram.memory().lost()) throw std::runtime_error("cannot write the template: " + vm.RamLostMessage());
  auto t2 = std::chrono::steady_clock::now();
  sections.push_back(Pod(kTagMemory, 0, r.memory));
  std::vector<uint8_t> bytes = EncodeStateFile(sections);
  r.state_bytes = bytes.size();
  WriteStateFile(dir + "/state.bin", sections);
  r.save_ms = Ms(t0, t1);
  r.memory_ms = Ms(t1, t2);
  return r;
}

std::shared_ptr<RestoreSpec> LoadTemplate(const std::string& dir, const std::string& what) {
  auto spec = std::make_shared<RestoreSpec>();
  spec->what = what;
  close(OpenStoreFile(dir, what, "directory", O_DIRECTORY));  // (whoever may write it may swap its files)
  spec->state = ReadStateFile(dir + "/state.bin", what);
  Meta meta = GetPod<Meta>(spec->state, kTagMeta, 0, what, "META");
  if (meta.version != kSnapshotVersion)
    throw CorruptError(what + " is corrupt: snapshot version " + std::to_string(meta.version) + " is not " +
                       std::to_string(kSnapshotVersion) + " (create the template again)");
  try {
    CheckVmSize(meta.vcpus, meta.memory_bytes);
  } catch (const std::exception& e) {
    throw CorruptError(what + " is corrupt: its state file says " + std::to_string(meta.vcpus) + " vCPUs and " +
                       std::to_string(meta.memory_bytes) + " bytes of memory (" + e.what() + ")");
  }
  MemoryFileInfo mem = GetPod<MemoryFileInfo>(spec->state, kTagMemory, 0, what, "memory file");
  if (mem.size != meta.memory_bytes)
    throw CorruptError(what + " is corrupt: the memory file size does not match the VM's memory");
  spec->memory_path = dir + "/memory.bin";
  int fd = OpenStoreFile(spec->memory_path, what, "memory file");
  spec->memory_fd = std::make_shared<const SharedFd>(fd);
  VerifyMemoryFile(fd, spec->memory_path, mem, what);  // (the file children map: checked through this fd)
  spec->memory_bytes = meta.memory_bytes;
  spec->vcpus = meta.vcpus;
  return spec;
}

BranchResult Branch(Vm& vm, const std::string& dir) {
  std::shared_ptr<const RestoreSpec> origin = vm.origin();
  if (!origin) throw std::runtime_error("only a sandbox restored from a template can be branched");
  using Clock = std::chrono::steady_clock;
  auto ns = [](Clock::time_point a, Clock::time_point b) {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  BranchResult r;
  // A packed VM's pages back, and its memslots, before the pre-copy reads RAM and turns on dirty logging.
  vm.Unpack();
  const GuestRam& ram = vm.ram();
  const uint64_t ram_pages = ram.size() / kPageSize;
  int fd = CreateTempDiffFile(dir);
  std::vector<Section> state;
  VirtioVsock* vsock = vm.vsock();
  bool logging = false;
  try {
    // Pre-copy while the guest runs. The vsock loop (which writes guest RAM
    // from its own thread, unseen by KVM's dirty log) is held still from
    // here until its state is saved; virtio-rng, which writes from vCPU
    // threads, gets its rings and buffers copied again in the pause.
    auto p0 = Clock::now();
    if (vsock) vsock->Pause();
    vm.SetDirtyLogging(true);
    logging = true;
    vm.TakeDirtyPages();  // start from a clean log
    // With the pages mapped from a pattern: the children map the template
    // and the layers only.
    std::vector<uint64_t> pages = FillGaps(WrittenPages(vm), kDiffRunBudget);
    DiffBuilder diff(fd, ram.size(), ram_pages);
    diff.Add(ram.host(), pages);
    auto p1 = Clock::now();
    r.precopy_ns = ns(p0, p1);
    r.precopy_pages = pages.size();

    auto t0 = Clock::now();
    vm.Hold();
    try {
      auto t1 = Clock::now();
      std::vector<uint64_t> again = vm.TakeDirtyPages();
      std::vector<uint64_t> rng = vm.RngWritablePages();
      again.insert(again.end(), rng.begin(), rng.end());
      std::sort(again.begin(), again.end());
      again.erase(std::unique(again.begin(), again.end()), again.end());
      auto t2 = Clock::now();
      diff.Add(ram.host(), again);
      auto t3 = Clock::now();
      state = vm.SaveState();  // also lets the vsock loop go again
      auto t4 = Clock::now();
      r.stop_ns = ns(t0, t1);
      r.scan_ns = ns(t1, t2);
      r.copy_ns = ns(t2, t3);
      r.save_ns = ns(t3, t4);
      r.recopied_pages = again.size();
    } catch (...) {
      vm.Release();
      throw;
    }
    vm.Release();
    r.pause_ns = ns(t0, Clock::now());
    vm.SetDirtyLogging(false);
    logging = false;
    if (ram.memory().lost()) throw std::runtime_error("cannot branch: " + vm.RamLostMessage());  // (the diff holds zeros; stopped below)
    diff.Finish(false);
    r.diff_pages = diff.pages();
    r.private_pages = CountPages(ram.host(), ram.size()).private_pages;
  } catch (...) {
    if (logging) {
      try {
        vm.SetDirtyLogging(false);
      } catch (...) {
      }
    }
    if (vsock) vsock->Resume();
    close(fd);
    // (writing the diff reads guest RAM in the kernel: EFAULT, no SIGBUS, where its file was cut short)
    if (ram.memory().lost() || vm.MemoryFileCut()) vm.Fail(vm.RamLostMessage());
    throw;
  }
  auto spec = std::make_shared<RestoreSpec>(*origin);
  spec->what = "branch of " + origin->what;
  spec->state = std::move(state);
  std::shared_ptr<DiffLayer> layer = DiffLayer::Open(fd, spec->what);
  r.runs = layer->runs().size();
  spec->layers.push_back(std::move(layer));
  if (spec->layers.size() > kMaxChainDepth) {
    int cfd = CreateTempDiffFile(dir);
    try {
      CollapseDiffs(spec->layers, cfd);
    } catch (...) {
      close(cfd);
      throw;
    }
    spec->layers = {DiffLayer::Open(cfd, spec->what)};
    r.collapsed = true;
  }
  r.depth = spec->layers.size();
  r.spec = std::move(spec);
  return r;
}

MemoryUsage MeasureGuestMemory(const Vm& vm) {
  MemoryUsage u;
  const GuestRam& ram = vm.ram();
  if (!ram.host()) return u;
  PageCounts c = CountPages(ram.host(), ram.size());
  u.guest_table_bytes = c.table_spans * kPageSize;
  if (ram.shared()) {
    u.guest_memfd_bytes = ram.ResidentBytes();
    return u;
  }
  u.guest_private_bytes = c.private_pages * kPageSize;
  u.guest_shared_bytes = c.shared_pages * kPageSize;
  if (const PatternBacking* pb = vm.pattern()) u.guest_pattern_bytes = pb->page_count() * kPageSize;
  return u;
}

std::vector<uint64_t> PrivateGuestFrames(const Vm& vm) {
  const GuestRam& ram = vm.ram();
  if (!ram.host() || ram.shared()) return {};
  std::vector<uint64_t> pages = PrivatePages(ram.host(), ram.size());
  // RAM is one host mapping; above low_size() it sits at 4 GiB in the guest.
  const uint64_t low_pages = ram.low_size() / kPageSize;
  for (uint64_t& p : pages) {
    if (p >= low_pages) p = p - low_pages + (layout::kHighRam / kPageSize);
  }
  return pages;
}

}  // namespace snapshot
}  // namespace forkling::vmm
