#include "vmm/snapshot/kvm_state.h"

#include <sys/ioctl.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <system_error>

namespace forkling::vmm::snapshot {
namespace {

// <linux/kvm.h> declares its variable-length structs with
// __DECLARE_FLEX_ARRAY, which in C++ adds a byte and changes the size encoded
// in the ioctl number; these are the numbers as C computes them.
struct Hdr4 {
  uint32_t n;
};
struct Hdr8 {
  uint32_t n;
  uint32_t pad;
};
struct XsaveArea {
  uint32_t region[1024];
};
constexpr unsigned long kGetMsrIndexList = _IOWR(KVMIO, 0x02, Hdr4);
constexpr unsigned long kGetMsrs = _IOWR(KVMIO, 0x88, Hdr8);
constexpr unsigned long kSetMsrs = _IOW(KVMIO, 0x89, Hdr8);
constexpr unsigned long kGetXsave = _IOR(KVMIO, 0xa4, XsaveArea);
constexpr unsigned long kSetXsave = _IOW(KVMIO, 0xa5, XsaveArea);
constexpr unsigned long kGetXsave2 = _IOR(KVMIO, 0xcf, XsaveArea);

// Upper bounds on what a (hostile or corrupt) state file may claim.
constexpr size_t kMaxMsrs = 4096;
constexpr size_t kMaxXsave = 1u << 20;

void Check(int r, const char* what) {
  if (r < 0) throw std::system_error(errno, std::generic_category(), what);
}

std::vector<uint8_t> MsrBuffer(size_t n) { return std::vector<uint8_t>(sizeof(Hdr8) + n * sizeof(kvm_msr_entry), 0); }

int XsaveSize(int vm_fd) {
  int n = ioctl(vm_fd, KVM_CHECK_EXTENSION, KVM_CAP_XSAVE2);
  return n >= 4096 ? n : 0;
}

}  // namespace

const std::vector<uint32_t>& SaveableMsrs(int kvm_fd, int vcpu_fd) {
  static std::once_flag once;
  static std::vector<uint32_t> list;
  static std::string error;
  std::call_once(once, [&] {
    std::vector<uint8_t> buf(sizeof(Hdr4));
    reinterpret_cast<Hdr4*>(buf.data())->n = 0;
    if (ioctl(kvm_fd, kGetMsrIndexList, buf.data()) < 0 && errno != E2BIG) {
      error = std::string("KVM_GET_MSR_INDEX_LIST: ") + std::strerror(errno);
      return;
    }
    uint32_t n = reinterpret_cast<Hdr4*>(buf.data())->n;
    if (n > kMaxMsrs) n = kMaxMsrs;
    buf.assign(sizeof(Hdr4) + n * 4, 0);
    reinterpret_cast<Hdr4*>(buf.data())->n = n;
    if (ioctl(kvm_fd, kGetMsrIndexList, buf.data()) < 0) {
      error = std::string("KVM_GET_MSR_INDEX_LIST: ") + std::strerror(errno);
      return;
    }
    n = reinterpret_cast<Hdr4*>(buf.data())->n;
    for (uint32_t i = 0; i < n; i++) {
      uint32_t index;
      std::memcpy(&index, buf.data() + sizeof(Hdr4) + i * 4, 4);
      std::vector<uint8_t> one = MsrBuffer(1);
      reinterpret_cast<Hdr8*>(one.data())->n = 1;
      reinterpret_cast<kvm_msr_entry*>(one.data() + sizeof(Hdr8))->index = index;
      // KVM_GET_MSRS returns how many it read: 1 when this one is readable.
      if (ioctl(vcpu_fd, kGetMsrs, one.data()) == 1) list.push_back(index);
    }
  });
  if (!error.empty()) throw std::runtime_error(error);
  return list;
}

VcpuState CaptureVcpu(int kvm_fd, int vm_fd, int vcpu_fd) {
  VcpuState s;
  std::memset(&s.regs, 0, sizeof s.regs);
  std::memset(&s.fpu, 0, sizeof s.fpu);
  std::memset(&s.xcrs, 0, sizeof s.xcrs);
  Check(ioctl(vcpu_fd, KVM_GET_REGS, &s.regs), "KVM_GET_REGS");
  Check(ioctl(vcpu_fd, KVM_GET_SREGS, &s.sregs), "KVM_GET_SREGS");
  if (int n = XsaveSize(vm_fd)) {
    s.xsave.assign(size_t(n), 0);
    Check(ioctl(vcpu_fd, kGetXsave2, s.xsave.data()), "KVM_GET_XSAVE2");
  } else if (ioctl(vm_fd, KVM_CHECK_EXTENSION, KVM_CAP_XSAVE) > 0) {
    s.xsave.assign(4096, 0);
    Check(ioctl(vcpu_fd, kGetXsave, s.xsave.data()), "KVM_GET_XSAVE");
  } else {
    Check(ioctl(vcpu_fd, KVM_GET_FPU, &s.fpu), "KVM_GET_FPU");
  }
  if (ioctl(vm_fd, KVM_CHECK_EXTENSION, KVM_CAP_XCRS) > 0) {
    Check(ioctl(vcpu_fd, KVM_GET_XCRS, &s.xcrs), "KVM_GET_XCRS");
    s.have_xcrs = true;
  }
  const std::vector<uint32_t>& indices = SaveableMsrs(kvm_fd, vcpu_fd);
  std::vector<uint8_t> buf = MsrBuffer(indices.size());
  auto* hdr = reinterpret_cast<Hdr8*>(buf.data());
  auto* e = reinterpret_cast<kvm_msr_entry*>(buf.data() + sizeof(Hdr8));
  hdr->n = uint32_t(indices.size());
  for (size_t i = 0; i < indices.size(); i++) e[i].index = indices[i];
  int got = ioctl(vcpu_fd, kGetMsrs, buf.data());
  Check(got, "KVM_GET_MSRS");
  if (size_t(got) != indices.size())
    throw std::runtime_error("KVM_GET_MSRS read " + std::to_string(got) + " of " + std::to_string(indices.size()) +
                             " MSRs (MSR " + std::to_string(e[got].index) + " failed)");
  s.msrs.assign(e, e + got);
  Check(ioctl(vcpu_fd, KVM_GET_LAPIC, &s.lapic), "KVM_GET_LAPIC");
  std::memset(&s.events, 0, sizeof s.events);
  Check(ioctl(vcpu_fd, KVM_GET_VCPU_EVENTS, &s.events), "KVM_GET_VCPU_EVENTS");
  Check(ioctl(vcpu_fd, KVM_GET_MP_STATE, &s.mp_state), "KVM_GET_MP_STATE");
  std::memset(&s.debugregs, 0, sizeof s.debugregs);
  Check(ioctl(vcpu_fd, KVM_GET_DEBUGREGS, &s.debugregs), "KVM_GET_DEBUGREGS");
  return s;
}

void RestoreVcpu(int vm_fd, int vcpu_fd, const VcpuState& s) {
  Check(ioctl(vcpu_fd, KVM_SET_SREGS, &s.sregs), "KVM_SET_SREGS");
  if (s.have_xcrs) Check(ioctl(vcpu_fd, KVM_SET_XCRS, &s.xcrs), "KVM_SET_XCRS");
  if (!s.xsave.empty()) {
    // KVM_SET_XSAVE reads as many bytes as KVM_CAP_XSAVE2 says (>= 4096): a
    // saved area smaller than this host's is padded with zeros (components
    // absent from XSTATE_BV stay in their initial state).
    size_t need = size_t(XsaveSize(vm_fd));
    if (need < 4096) need = 4096;
    std::vector<uint8_t> area(std::max(need, s.xsave.size()), 0);
    std::memcpy(area.data(), s.xsave.data(), s.xsave.size());
    Check(ioctl(vcpu_fd, kSetXsave, area.data()), "KVM_SET_XSAVE");
  } else {
    Check(ioctl(vcpu_fd, KVM_SET_FPU, &s.fpu), "KVM_SET_FPU");
  }
  Check(ioctl(vcpu_fd, KVM_SET_REGS, &s.regs), "KVM_SET_REGS");
  Check(ioctl(vcpu_fd, KVM_SET_LAPIC, &s.lapic), "KVM_SET_LAPIC");
  std::vector<uint8_t> buf = MsrBuffer(s.msrs.size());
  reinterpret_cast<Hdr8*>(buf.data())->n = uint32_t(s.msrs.size());
  std::memcpy(buf.data() + sizeof(Hdr8), s.msrs.data(), s.msrs.size() * sizeof(kvm_msr_entry));
  int set = ioctl(vcpu_fd, kSetMsrs, buf.data());
  Check(set, "KVM_SET_MSRS");
  if (size_t(set) != s.msrs.size())
    throw std::runtime_error("KVM_SET_MSRS set " + std::to_string(set) + " of " + std::to_string(s.msrs.size()) +
                             " MSRs (MSR 0x" + [&] {
                               char b[16];
                               snprintf(b, sizeof b, "%x", s.msrs[size_t(set)].index);
                               return std::string(b);
                             }() + " was refused)");
  Check(ioctl(vcpu_fd, KVM_SET_MP_STATE, &s.mp_state), "KVM_SET_MP_STATE");
  // GET does not set these two flags, but the fields it filled are current:
  // without them SET would drop a pending NMI and the SIPI vector.
  kvm_vcpu_events ev = s.events;
  ev.flags |= KVM_VCPUEVENT_VALID_NMI_PENDING | KVM_VCPUEVENT_VALID_SIPI_VECTOR;
  Check(ioctl(vcpu_fd, KVM_SET_VCPU_EVENTS, &ev), "KVM_SET_VCPU_EVENTS");
  Check(ioctl(vcpu_fd, KVM_SET_DEBUGREGS, &s.debugregs), "KVM_SET_DEBUGREGS");
}

VmKvmState CaptureVm(int vm_fd) {
  VmKvmState s;
  std::memset(&s, 0, sizeof s);
  s.pic_master.chip_id = KVM_IRQCHIP_PIC_MASTER;
  s.pic_slave.chip_id = KVM_IRQCHIP_PIC_SLAVE;
  s.ioapic.chip_id = KVM_IRQCHIP_IOAPIC;
  Check(ioctl(vm_fd, KVM_GET_IRQCHIP, &s.pic_master), "KVM_GET_IRQCHIP (PIC master)");
  Check(ioctl(vm_fd, KVM_GET_IRQCHIP, &s.pic_slave), "KVM_GET_IRQCHIP (PIC slave)");
  Check(ioctl(vm_fd, KVM_GET_IRQCHIP, &s.ioapic), "KVM_GET_IRQCHIP (IOAPIC)");
  Check(ioctl(vm_fd, KVM_GET_PIT2, &s.pit), "KVM_GET_PIT2");
  Check(ioctl(vm_fd, KVM_GET_CLOCK, &s.clock), "KVM_GET_CLOCK");
  return s;
}

void RestoreVm(int vm_fd, const VmKvmState& s) {
  Check(ioctl(vm_fd, KVM_SET_IRQCHIP, &s.pic_master), "KVM_SET_IRQCHIP (PIC master)");
  Check(ioctl(vm_fd, KVM_SET_IRQCHIP, &s.pic_slave), "KVM_SET_IRQCHIP (PIC slave)");
  Check(ioctl(vm_fd, KVM_SET_IRQCHIP, &s.ioapic), "KVM_SET_IRQCHIP (IOAPIC)");
  Check(ioctl(vm_fd, KVM_SET_PIT2, &s.pit), "KVM_SET_PIT2");
  // Only the clock value: no KVM_CLOCK_REALTIME, which would advance the
  // guest's monotonic clock by the template's age.
  kvm_clock_data c;
  std::memset(&c, 0, sizeof c);
  c.clock = s.clock.clock;
  Check(ioctl(vm_fd, KVM_SET_CLOCK, &c), "KVM_SET_CLOCK");
}

Section EncodeVcpu(uint32_t index, const VcpuState& s) {
  ByteWriter w;
  w.Put(s.regs);
  w.Put(s.sregs);
  w.PutBlob(s.xsave.data(), s.xsave.size());
  w.Put(s.fpu);
  w.Put(uint8_t(s.have_xcrs));
  w.Put(s.xcrs);
  w.PutBlob(s.msrs.data(), s.msrs.size() * sizeof(kvm_msr_entry));
  w.Put(s.lapic);
  w.Put(s.events);
  w.Put(s.mp_state);
  w.Put(s.debugregs);
  return Section{kTagVcpu, index, std::move(w.bytes())};
}

VcpuState DecodeVcpu(const Section& sec, const std::string& what) {
  ByteReader r(sec.data, what + " is corrupt: vCPU " + std::to_string(sec.index));
  VcpuState s;
  s.regs = r.Get<kvm_regs>();
  s.sregs = r.Get<kvm_sregs>();
  s.xsave = r.GetBlob(kMaxXsave);
  if (!s.xsave.empty() && s.xsave.size() < 4096)
    throw CorruptError(what + " is corrupt: vCPU " + std::to_string(sec.index) + " has a short XSAVE area");
  s.fpu = r.Get<kvm_fpu>();
  s.have_xcrs = r.Get<uint8_t>() != 0;
  s.xcrs = r.Get<kvm_xcrs>();
  if (s.xcrs.nr_xcrs > KVM_MAX_XCRS)
    throw CorruptError(what + " is corrupt: vCPU " + std::to_string(sec.index) + " has too many XCRs");
  std::vector<uint8_t> m = r.GetBlob(kMaxMsrs * sizeof(kvm_msr_entry));
  if (m.size() % sizeof(kvm_msr_entry))
    throw CorruptError(what + " is corrupt: vCPU " + std::to_string(sec.index) + " has a ragged MSR list");
  s.msrs.resize(m.size() / sizeof(kvm_msr_entry));
  std::memcpy(s.msrs.data(), m.data(), m.size());
  s.lapic = r.Get<kvm_lapic_state>();
  s.events = r.Get<kvm_vcpu_events>();
  s.mp_state = r.Get<kvm_mp_state>();
  s.debugregs = r.Get<kvm_debugregs>();
  r.ExpectDone();
  return s;
}

Section EncodeVm(const VmKvmState& s) {
  ByteWriter w;
  w.Put(s);
  return Section{kTagVm, 0, std::move(w.bytes())};
}

VmKvmState DecodeVm(const Section& sec, const std::string& what) {
  ByteReader r(sec.data, what + " is corrupt: VM state");
  VmKvmState s = r.Get<VmKvmState>();
  r.ExpectDone();
  return s;
}

void CaptureKvmSections(int kvm_fd, int vm_fd, const std::vector<int>& vcpu_fds, std::vector<Section>& out) {
  out.push_back(EncodeVm(CaptureVm(vm_fd)));
  for (uint32_t i = 0; i < vcpu_fds.size(); i++) out.push_back(EncodeVcpu(i, CaptureVcpu(kvm_fd, vm_fd, vcpu_fds[i])));
}

KvmState DecodeKvmSections(const std::vector<Section>& sections, uint32_t vcpus, const std::string& what) {
  const Section* vm = FindSection(sections, kTagVm);
  if (!vm) throw CorruptError(what + " is corrupt: state file has no KVM VM section");
  KvmState k{DecodeVm(*vm, what), {}};
  for (uint32_t i = 0; i < vcpus; i++) {
    const Section* v = FindSection(sections, kTagVcpu, i);
    if (!v) throw CorruptError(what + " is corrupt: state file has no section for vCPU " + std::to_string(i));
    k.vcpus.push_back(DecodeVcpu(*v, what));
  }
  return k;
}

}  // namespace forkling::vmm::snapshot
