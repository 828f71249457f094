// The raw syscall layer: /dev/kvm and its ioctls, mmap/munmap/madvise,
// memfd_create, eventfd, ftruncate, close. Small and generic on purpose: the
// engines build on it from TypeScript; the VMM's hot path lives in C++ elsewhere.
//
// Conventions (mirrored by host/native.ts):
// - failures throw ErrnoError (code = errno name, syscall = the call);
//   malformed arguments throw TypeError/RangeError before any syscall;
// - file descriptors are numbers; the caller owns and closes them;
// - 64-bit register/address quantities are bigint, narrower fields are numbers.
#include <fcntl.h>
#include <linux/kvm.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "errno_error.h"
#include "js_uint.h"
#include "mapping.h"

namespace forkling {
namespace {

// ---------------------------------------------------------------- arguments

int ArgInt(const Napi::CallbackInfo& info, size_t i, const char* name) {
  Napi::Value v = info[i];
  if (!v.IsNumber()) throw Napi::TypeError::New(info.Env(), std::string(name) + " must be a number");
  double d = v.As<Napi::Number>().DoubleValue();
  if (d != static_cast<double>(static_cast<int32_t>(d))) {
    throw Napi::RangeError::New(info.Env(), std::string(name) + " must be a 32-bit integer");
  }
  return static_cast<int32_t>(d);
}

int ArgIntOr(const Napi::CallbackInfo& info, size_t i, const char* name, int def) {
  if (info.Length() <= i || info[i].IsUndefined()) return def;
  return ArgInt(info, i, name);
}

Napi::Object ArgObject(const Napi::CallbackInfo& info, size_t i, const char* name) {
  if (!info[i].IsObject()) throw Napi::TypeError::New(info.Env(), std::string(name) + " must be an object");
  return info[i].As<Napi::Object>();
}

// Register-sized fields: bigint only (a number would silently lose bits above 2^53).
uint64_t GetBig(Napi::Object o, const char* field) {
  Napi::Value v = o.Get(field);
  if (!v.IsBigInt()) throw Napi::TypeError::New(o.Env(), std::string(field) + " must be a bigint");
  bool lossless = false;
  uint64_t x = v.As<Napi::BigInt>().Uint64Value(&lossless);
  if (!lossless) {
    // Accept negative bigints in the signed 64-bit range (two's complement).
    int64_t s = v.As<Napi::BigInt>().Int64Value(&lossless);
    if (!lossless) throw Napi::RangeError::New(o.Env(), std::string(field) + " must fit in 64 bits");
    x = static_cast<uint64_t>(s);
  }
  return x;
}

uint32_t GetU32(Napi::Object o, const char* field, uint32_t max = UINT32_MAX) {
  Napi::Value v = o.Get(field);
  if (!v.IsNumber()) throw Napi::TypeError::New(o.Env(), std::string(field) + " must be a number");
  double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= 0) || d > max || d != static_cast<double>(static_cast<uint32_t>(d))) {
    throw Napi::RangeError::New(o.Env(), std::string(field) + " out of range (0.." + std::to_string(max) + ")");
  }
  return static_cast<uint32_t>(d);
}

Napi::BigInt Big(Napi::Env env, uint64_t x) { return Napi::BigInt::New(env, x); }

// ---------------------------------------------------------------- mappings

// Live mappings by start address: lets KVM_SET_USER_MEMORY_REGION refuse
// addresses that are not (or no longer) memory this addon mapped.
std::mutex g_live_mu;
std::map<uintptr_t, size_t> g_live;

void LiveAdd(void* p, size_t n) {
  std::lock_guard<std::mutex> l(g_live_mu);
  g_live[reinterpret_cast<uintptr_t>(p)] = n;
}
void LiveRemove(void* p) {
  std::lock_guard<std::mutex> l(g_live_mu);
  g_live.erase(reinterpret_cast<uintptr_t>(p));
}

// Shared between the Mapping object and the ArrayBuffer's finalizer: the
// memory is released exactly once, by unmap() or by whichever is collected last.
struct MapState {
  void* addr = nullptr;
  size_t length = 0;
  bool mapped = false;
  ~MapState() {
    if (mapped) {
      LiveRemove(addr);
      munmap(addr, length);
    }
  }
};

// Mapping constructors per Node environment (main thread, each worker); instance
// data is left free for other parts of the addon.
std::mutex g_ctor_mu;
std::map<napi_env, Napi::FunctionReference*> g_ctors;

Napi::FunctionReference* MappingCtor(Napi::Env env) {
  std::lock_guard<std::mutex> l(g_ctor_mu);
  auto it = g_ctors.find(env);
  return it == g_ctors.end() ? nullptr : it->second;
}

// Marks objects made by this addon's Mapping class, whichever environment made them.
const napi_type_tag kMappingTag = {0x666f726b6c696e67ULL, 0x6d617070696e6721ULL};

class Mapping : public Napi::ObjectWrap<Mapping> {
 public:

  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "Mapping",
                       {
                           InstanceAccessor<&Mapping::GetBuffer>("buffer"),
                           InstanceAccessor<&Mapping::GetAddress>("address"),
                           InstanceAccessor<&Mapping::GetLength>("length"),
                           InstanceAccessor<&Mapping::GetMapped>("mapped"),
                           InstanceMethod<&Mapping::Unmap>("unmap"),
                       });
  }

  // Constructed only from mmap() below, with an External<std::shared_ptr<MapState>>.
  explicit Mapping(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Mapping>(info) {
    if (info.Length() != 2 || !info[0].IsExternal()) {
      throw Napi::TypeError::New(info.Env(), "Mapping objects are made by mmap()");
    }
    state_ = *info[0].As<Napi::External<std::shared_ptr<MapState>>>().Data();
    info.This().As<Napi::Object>().TypeTag(&kMappingTag);
    if (info[1].IsArrayBuffer()) buffer_ = Napi::Persistent(info[1].As<Napi::ArrayBuffer>());
  }

  const std::shared_ptr<MapState>& state() const { return state_; }

  // Detaches the ArrayBuffer first, so no JS view can reach the memory after munmap.
  void DoUnmap(Napi::Env env) {
    if (!state_->mapped) return;
    if (!buffer_.IsEmpty()) {
      Napi::ArrayBuffer ab = buffer_.Value();
      if (!ab.IsDetached()) ab.Detach();
      buffer_.Reset();
    }
    LiveRemove(state_->addr);
    state_->mapped = false;
    if (munmap(state_->addr, state_->length) != 0) throw ErrnoError(env, "munmap", errno);
  }

 private:
  Napi::Value GetBuffer(const Napi::CallbackInfo& info) {
    if (!state_->mapped || buffer_.IsEmpty()) return info.Env().Null();
    return buffer_.Value();
  }
  Napi::Value GetAddress(const Napi::CallbackInfo& info) {
    return Big(info.Env(), reinterpret_cast<uintptr_t>(state_->addr));
  }
  Napi::Value GetLength(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), static_cast<double>(state_->length));
  }
  Napi::Value GetMapped(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), state_->mapped); }
  Napi::Value Unmap(const Napi::CallbackInfo& info) {
    DoUnmap(info.Env());
    return info.Env().Undefined();
  }

  std::shared_ptr<MapState> state_;
  Napi::Reference<Napi::ArrayBuffer> buffer_;
};

Mapping* TryUnwrap(Napi::Value v) {
  if (!v.IsObject() || !v.As<Napi::Object>().CheckTypeTag(&kMappingTag)) return nullptr;
  return Mapping::Unwrap(v.As<Napi::Object>());
}

Mapping* UnwrapMapping(Napi::Env env, Napi::Value v, const char* what) {
  if (Mapping* m = TryUnwrap(v)) return m;
  throw Napi::TypeError::New(env, std::string(what) + " must be a Mapping returned by mmap()");
}

Mapping* LiveMapping(Napi::Env env, Napi::Value v, const char* what) {
  Mapping* m = UnwrapMapping(env, v, what);
  if (!m->state()->mapped) throw Napi::Error::New(env, std::string(what) + " is already unmapped");
  return m;
}

// mmap(length, prot, flags, fd = -1, offset = 0) -> Mapping
Napi::Value Mmap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  uint64_t length = ToU64(env, info[0], "length");
  int prot = ArgInt(info, 1, "prot");
  int flags = ArgInt(info, 2, "flags");
  int fd = ArgIntOr(info, 3, "fd", -1);
  uint64_t offset = info.Length() > 4 && !info[4].IsUndefined() ? ToU64(env, info[4], "offset") : 0;
  // A fixed address could silently replace memory the runtime owns.
  if (flags & (MAP_FIXED | MAP_FIXED_NOREPLACE)) {
    throw Napi::RangeError::New(env, "mmap: MAP_FIXED and MAP_FIXED_NOREPLACE are not supported");
  }
  void* p = mmap(nullptr, length, prot, flags, fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) throw ErrnoError(env, "mmap", errno);

  auto state = std::make_shared<MapState>();
  state->addr = p;
  state->length = length;
  state->mapped = true;
  LiveAdd(p, length);

  // JS gets a view only when the memory is readable and writable: touching a
  // PROT_NONE/read-only page through an ArrayBuffer would kill the process.
  Napi::Value buffer = env.Null();
  const bool rw = (prot & (PROT_READ | PROT_WRITE)) == (PROT_READ | PROT_WRITE);
  if (rw) {
    auto* hint = new std::shared_ptr<MapState>(state);
    try {
      buffer = Napi::ArrayBuffer::New(
          env, p, length, [](Napi::Env, void*, std::shared_ptr<MapState>* h) { delete h; }, hint);
    } catch (...) {
      delete hint;
      throw;  // ~MapState unmaps
    }
  }
  Napi::External<std::shared_ptr<MapState>> ext = Napi::External<std::shared_ptr<MapState>>::New(env, &state);
  return MappingCtor(env)->New({ext, buffer});
}

// munmap(mapping): same as mapping.unmap(); the ArrayBuffer is detached first.
Napi::Value Munmap(const Napi::CallbackInfo& info) {
  UnwrapMapping(info.Env(), info[0], "mapping")->DoUnmap(info.Env());
  return info.Env().Undefined();
}

// madvise(mapping, offset, length, advice): the range must lie inside the mapping.
Napi::Value Madvise(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Mapping* m = LiveMapping(env, info[0], "mapping");
  uint64_t offset = ToU64(env, info[1], "offset");
  uint64_t length = ToU64(env, info[2], "length");
  int advice = ArgInt(info, 3, "advice");
  const size_t total = m->state()->length;
  if (offset > total || length > total - offset) {
    throw Napi::RangeError::New(env, "madvise: range lies outside the mapping");
  }
  if (madvise(static_cast<char*>(m->state()->addr) + offset, length, advice) != 0) {
    throw ErrnoError(env, "madvise", errno);
  }
  return env.Undefined();
}

// ---------------------------------------------------------------- fds

Napi::Value Close(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "fd");
  if (close(fd) != 0 && errno != EINTR) throw ErrnoError(info.Env(), "close", errno);
  return info.Env().Undefined();
}

Napi::Value MemfdCreate(const Napi::CallbackInfo& info) {
  if (!info[0].IsString()) throw Napi::TypeError::New(info.Env(), "name must be a string");
  std::string name = info[0].As<Napi::String>().Utf8Value();
  int flags = ArgIntOr(info, 1, "flags", MFD_CLOEXEC);
  int fd = memfd_create(name.c_str(), static_cast<unsigned>(flags));
  if (fd < 0) throw ErrnoError(info.Env(), "memfd_create", errno);
  return Napi::Number::New(info.Env(), fd);
}

Napi::Value Eventfd(const Napi::CallbackInfo& info) {
  int init = ArgIntOr(info, 0, "initval", 0);
  if (init < 0) throw Napi::RangeError::New(info.Env(), "initval must be >= 0");
  int flags = ArgIntOr(info, 1, "flags", EFD_CLOEXEC);
  int fd = eventfd(static_cast<unsigned>(init), flags);
  if (fd < 0) throw ErrnoError(info.Env(), "eventfd", errno);
  return Napi::Number::New(info.Env(), fd);
}

Napi::Value Ftruncate(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "fd");
  uint64_t len = ToU64(info.Env(), info[1], "length");
  if (len > static_cast<uint64_t>(INT64_MAX)) throw Napi::RangeError::New(info.Env(), "length too large");
  if (ftruncate(fd, static_cast<off_t>(len)) != 0) throw ErrnoError(info.Env(), "ftruncate", errno);
  return info.Env().Undefined();
}

// ---------------------------------------------------------------- KVM

Napi::Value OpenKvm(const Napi::CallbackInfo& info) {
  int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (fd < 0) throw ErrnoError(info.Env(), "open /dev/kvm", errno);
  return Napi::Number::New(info.Env(), fd);
}

// An ioctl whose result is a plain integer (or a new fd).
int IoctlInt(Napi::Env env, int fd, unsigned long req, unsigned long arg, const char* name) {
  int r;
  do r = ioctl(fd, req, arg);
  while (r < 0 && errno == EINTR);
  if (r < 0) throw ErrnoError(env, name, errno);
  return r;
}

Napi::Value KvmGetApiVersion(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), IoctlInt(info.Env(), ArgInt(info, 0, "kvmFd"), KVM_GET_API_VERSION, 0, "KVM_GET_API_VERSION"));
}

// Works on the /dev/kvm fd or a VM fd (per-VM answers).
Napi::Value KvmCheckExtension(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "fd");
  int cap = ArgInt(info, 1, "cap");
  return Napi::Number::New(info.Env(), IoctlInt(info.Env(), fd, KVM_CHECK_EXTENSION, static_cast<unsigned long>(cap), "KVM_CHECK_EXTENSION"));
}

Napi::Value KvmCreateVm(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "kvmFd");
  int type = ArgIntOr(info, 1, "type", 0);
  return Napi::Number::New(info.Env(), IoctlInt(info.Env(), fd, KVM_CREATE_VM, static_cast<unsigned long>(type), "KVM_CREATE_VM"));
}

Napi::Value KvmGetVcpuMmapSize(const Napi::CallbackInfo& info) {
  return Napi::Number::New(info.Env(), IoctlInt(info.Env(), ArgInt(info, 0, "kvmFd"), KVM_GET_VCPU_MMAP_SIZE, 0, "KVM_GET_VCPU_MMAP_SIZE"));
}

Napi::Value KvmCreateVcpu(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "vmFd");
  int id = ArgInt(info, 1, "id");
  if (id < 0) throw Napi::RangeError::New(info.Env(), "vcpu id must be >= 0");
  return Napi::Number::New(info.Env(), IoctlInt(info.Env(), fd, KVM_CREATE_VCPU, static_cast<unsigned long>(id), "KVM_CREATE_VCPU"));
}

Napi::Value KvmSetTssAddr(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "vmFd");
  uint64_t addr = ToU64(info.Env(), info[1], "addr");
  if (addr > UINT32_MAX - 3 * 4096) throw Napi::RangeError::New(info.Env(), "TSS address must lie below 4 GiB");
  IoctlInt(info.Env(), fd, KVM_SET_TSS_ADDR, static_cast<unsigned long>(addr), "KVM_SET_TSS_ADDR");
  return info.Env().Undefined();
}

// kvmSetUserMemoryRegion(vmFd, {slot, flags, guestPhysAddr, memorySize, userspaceAddr})
// The host range must be memory mapped by mmap() above (or memorySize 0 to delete a slot).
Napi::Value KvmSetUserMemoryRegion(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = ArgInt(info, 0, "vmFd");
  Napi::Object o = ArgObject(info, 1, "region");
  kvm_userspace_memory_region r{};
  r.slot = GetU32(o, "slot");
  r.flags = GetU32(o, "flags");
  r.guest_phys_addr = GetBig(o, "guestPhysAddr");
  r.memory_size = GetBig(o, "memorySize");
  r.userspace_addr = GetBig(o, "userspaceAddr");
  if (r.memory_size != 0 && !IsLiveMappingRange(r.userspace_addr, r.memory_size)) {
    throw Napi::RangeError::New(env, "userspaceAddr..+memorySize must lie inside one live Mapping from mmap()");
  }
  IoctlInt(env, fd, KVM_SET_USER_MEMORY_REGION, reinterpret_cast<unsigned long>(&r), "KVM_SET_USER_MEMORY_REGION");
  return env.Undefined();
}

#define REGS_FIELDS(X) \
  X(rax) X(rbx) X(rcx) X(rdx) X(rsi) X(rdi) X(rsp) X(rbp) X(r8) X(r9) X(r10) X(r11) X(r12) X(r13) X(r14) X(r15) X(rip) X(rflags)

Napi::Value KvmGetRegs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  kvm_regs r{};
  IoctlInt(env, ArgInt(info, 0, "vcpuFd"), KVM_GET_REGS, reinterpret_cast<unsigned long>(&r), "KVM_GET_REGS");
  Napi::Object o = Napi::Object::New(env);
#define X(f) o.Set(#f, Big(env, r.f));
  REGS_FIELDS(X)
#undef X
  return o;
}

Napi::Value KvmSetRegs(const Napi::CallbackInfo& info) {
  int fd = ArgInt(info, 0, "vcpuFd");
  Napi::Object o = ArgObject(info, 1, "regs");
  kvm_regs r{};
#define X(f) r.f = GetBig(o, #f);
  REGS_FIELDS(X)
#undef X
  IoctlInt(info.Env(), fd, KVM_SET_REGS, reinterpret_cast<unsigned long>(&r), "KVM_SET_REGS");
  return info.Env().Undefined();
}

#define SEG_BYTE_FIELDS(X) X(type) X(present) X(dpl) X(db) X(s) X(l) X(g) X(avl) X(unusable)
#define SREGS_SEGMENTS(X) X(cs) X(ds) X(es) X(fs) X(gs) X(ss) X(tr) X(ldt)
#define SREGS_CONTROL(X) X(cr0, cr0) X(cr2, cr2) X(cr3, cr3) X(cr4, cr4) X(cr8, cr8) X(efer, efer) X(apicBase, apic_base)

Napi::Object SegToJs(Napi::Env env, const kvm_segment& s) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("base", Big(env, s.base));
  o.Set("limit", Napi::Number::New(env, s.limit));
  o.Set("selector", Napi::Number::New(env, s.selector));
#define X(f) o.Set(#f, Napi::Number::New(env, s.f));
  SEG_BYTE_FIELDS(X)
#undef X
  return o;
}

kvm_segment SegFromJs(Napi::Env env, Napi::Value v, const char* name) {
  if (!v.IsObject()) throw Napi::TypeError::New(env, std::string(name) + " must be a segment object");
  Napi::Object o = v.As<Napi::Object>();
  kvm_segment s{};
  s.base = GetBig(o, "base");
  s.limit = GetU32(o, "limit");
  s.selector = static_cast<uint16_t>(GetU32(o, "selector", 0xffff));
#define X(f) s.f = static_cast<uint8_t>(GetU32(o, #f, 0xff));
  SEG_BYTE_FIELDS(X)
#undef X
  return s;
}

Napi::Object DtToJs(Napi::Env env, const kvm_dtable& d) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("base", Big(env, d.base));
  o.Set("limit", Napi::Number::New(env, d.limit));
  return o;
}

kvm_dtable DtFromJs(Napi::Env env, Napi::Value v, const char* name) {
  if (!v.IsObject()) throw Napi::TypeError::New(env, std::string(name) + " must be a {base, limit} object");
  Napi::Object o = v.As<Napi::Object>();
  kvm_dtable d{};
  d.base = GetBig(o, "base");
  d.limit = static_cast<uint16_t>(GetU32(o, "limit", 0xffff));
  return d;
}

Napi::Value KvmGetSregs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  kvm_sregs s{};
  IoctlInt(env, ArgInt(info, 0, "vcpuFd"), KVM_GET_SREGS, reinterpret_cast<unsigned long>(&s), "KVM_GET_SREGS");
  Napi::Object o = Napi::Object::New(env);
#define X(f) o.Set(#f, SegToJs(env, s.f));
  SREGS_SEGMENTS(X)
#undef X
  o.Set("gdt", DtToJs(env, s.gdt));
  o.Set("idt", DtToJs(env, s.idt));
#define X(js, c) o.Set(#js, Big(env, s.c));
  SREGS_CONTROL(X)
#undef X
  Napi::Array bm = Napi::Array::New(env, 4);
  for (uint32_t i = 0; i < 4; i++) bm.Set(i, Big(env, s.interrupt_bitmap[i]));
  o.Set("interruptBitmap", bm);
  return o;
}

Napi::Value KvmSetSregs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = ArgInt(info, 0, "vcpuFd");
  Napi::Object o = ArgObject(info, 1, "sregs");
  kvm_sregs s{};
#define X(f) s.f = SegFromJs(env, o.Get(#f), #f);
  SREGS_SEGMENTS(X)
#undef X
  s.gdt = DtFromJs(env, o.Get("gdt"), "gdt");
  s.idt = DtFromJs(env, o.Get("idt"), "idt");
#define X(js, c) s.c = GetBig(o, #js);
  SREGS_CONTROL(X)
#undef X
  Napi::Value bmv = o.Get("interruptBitmap");
  if (!bmv.IsArray() || bmv.As<Napi::Array>().Length() != 4) {
    throw Napi::TypeError::New(env, "interruptBitmap must be an array of 4 bigints");
  }
  Napi::Object bm = bmv.As<Napi::Object>();
  for (uint32_t i = 0; i < 4; i++) {
    Napi::Value e = bm.Get(i);
    if (!e.IsBigInt()) throw Napi::TypeError::New(env, "interruptBitmap must be an array of 4 bigints");
    bool lossless = false;
    s.interrupt_bitmap[i] = e.As<Napi::BigInt>().Uint64Value(&lossless);
    if (!lossless) throw Napi::RangeError::New(env, "interruptBitmap entries must fit in 64 bits");
  }
  IoctlInt(env, fd, KVM_SET_SREGS, reinterpret_cast<unsigned long>(&s), "KVM_SET_SREGS");
  return env.Undefined();
}

const char* ExitName(uint32_t r) {
  switch (r) {
#define X(n) case KVM_EXIT_##n: return #n;
    X(UNKNOWN) X(EXCEPTION) X(IO) X(HYPERCALL) X(DEBUG) X(HLT) X(MMIO) X(IRQ_WINDOW_OPEN) X(SHUTDOWN)
    X(FAIL_ENTRY) X(INTR) X(SET_TPR) X(TPR_ACCESS) X(NMI) X(INTERNAL_ERROR) X(WATCHDOG) X(SYSTEM_EVENT)
    X(IOAPIC_EOI) X(HYPERV) X(X86_RDMSR) X(X86_WRMSR) X(DIRTY_RING_FULL) X(AP_RESET_HOLD) X(X86_BUS_LOCK)
#ifdef KVM_EXIT_NOTIFY
    X(NOTIFY)
#endif
#undef X
    default: return "OTHER";
  }
}

Napi::Array U64Array(Napi::Env env, const __u64* d, uint32_t n) {
  Napi::Array a = Napi::Array::New(env, n);
  for (uint32_t i = 0; i < n; i++) a.Set(i, Big(env, d[i]));
  return a;
}

// kvmRun(vcpuFd, runMapping) -> exit. `runMapping` is the vCPU fd mmapped with
// KVM_GET_VCPU_MMAP_SIZE bytes; the decoded fields are read from it. For an
// IO-in or MMIO-read exit, write the answer into the mapping (io.dataOffset /
// KVM_RUN_MMIO_DATA_OFFSET) before the next kvmRun.
Napi::Value KvmRun(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = ArgInt(info, 0, "vcpuFd");
  Mapping* m = LiveMapping(env, info[1], "runMapping");
  if (m->state()->length < sizeof(kvm_run)) throw Napi::RangeError::New(env, "runMapping is smaller than struct kvm_run");
  auto* run = static_cast<kvm_run*>(m->state()->addr);
  const size_t mapLen = m->state()->length;

  Napi::Object o = Napi::Object::New(env);
  if (ioctl(fd, KVM_RUN, 0) < 0) {
    // A signal ended the run early: report it as an exit, like the kernel does.
    if (errno != EINTR && errno != EAGAIN) throw ErrnoError(env, "KVM_RUN", errno);
    o.Set("reason", Napi::Number::New(env, KVM_EXIT_INTR));
    o.Set("reasonName", Napi::String::New(env, "INTR"));
    return o;
  }
  const uint32_t reason = run->exit_reason;
  o.Set("reason", Napi::Number::New(env, reason));
  o.Set("reasonName", Napi::String::New(env, ExitName(reason)));
  switch (reason) {
    case KVM_EXIT_IO: {
      Napi::Object io = Napi::Object::New(env);
      const uint64_t bytes = static_cast<uint64_t>(run->io.size) * run->io.count;
      if (run->io.data_offset > mapLen || bytes > mapLen - run->io.data_offset) {
        throw Napi::Error::New(env, "KVM_RUN: io data lies outside the run mapping");
      }
      io.Set("direction", Napi::Number::New(env, run->io.direction));
      io.Set("size", Napi::Number::New(env, run->io.size));
      io.Set("port", Napi::Number::New(env, run->io.port));
      io.Set("count", Napi::Number::New(env, run->io.count));
      io.Set("dataOffset", Napi::Number::New(env, static_cast<double>(run->io.data_offset)));
      io.Set("data", Napi::Buffer<uint8_t>::Copy(env, reinterpret_cast<uint8_t*>(run) + run->io.data_offset, bytes));
      o.Set("io", io);
      break;
    }
    case KVM_EXIT_MMIO: {
      Napi::Object mm = Napi::Object::New(env);
      const uint32_t len = run->mmio.len <= sizeof(run->mmio.data) ? run->mmio.len : sizeof(run->mmio.data);
      mm.Set("physAddr", Big(env, run->mmio.phys_addr));
      mm.Set("len", Napi::Number::New(env, run->mmio.len));
      mm.Set("isWrite", Napi::Boolean::New(env, run->mmio.is_write != 0));
      mm.Set("data", Napi::Buffer<uint8_t>::Copy(env, run->mmio.data, len));
      o.Set("mmio", mm);
      break;
    }
    case KVM_EXIT_INTERNAL_ERROR: {
      Napi::Object ie = Napi::Object::New(env);
      const uint32_t n = run->internal.ndata <= 16 ? run->internal.ndata : 16;
      ie.Set("suberror", Napi::Number::New(env, run->internal.suberror));
      ie.Set("ndata", Napi::Number::New(env, run->internal.ndata));
      ie.Set("data", U64Array(env, run->internal.data, n));
      o.Set("internal", ie);
      break;
    }
    case KVM_EXIT_FAIL_ENTRY: {
      Napi::Object fe = Napi::Object::New(env);
      fe.Set("hardwareEntryFailureReason", Big(env, run->fail_entry.hardware_entry_failure_reason));
      fe.Set("cpu", Napi::Number::New(env, run->fail_entry.cpu));
      o.Set("failEntry", fe);
      break;
    }
    case KVM_EXIT_UNKNOWN:
      o.Set("hardwareExitReason", Big(env, run->hw.hardware_exit_reason));
      break;
    case KVM_EXIT_SYSTEM_EVENT: {
      Napi::Object se = Napi::Object::New(env);
      se.Set("type", Napi::Number::New(env, run->system_event.type));
      const uint32_t n = run->system_event.ndata <= 16 ? run->system_event.ndata : 16;
      se.Set("data", U64Array(env, run->system_event.data, n));
      o.Set("systemEvent", se);
      break;
    }
    default:
      break;
  }
  return o;
}

// ---------------------------------------------------------------- constants

Napi::Object Constants(Napi::Env env) {
  Napi::Object c = Napi::Object::New(env);
  auto set = [&](const char* n, double v) { c.Set(n, Napi::Number::New(env, v)); };
#define C(n) set(#n, n);
  C(PROT_NONE) C(PROT_READ) C(PROT_WRITE) C(PROT_EXEC)
  C(MAP_SHARED) C(MAP_PRIVATE) C(MAP_ANONYMOUS) C(MAP_NORESERVE) C(MAP_POPULATE) C(MAP_HUGETLB)
  C(MADV_NORMAL) C(MADV_RANDOM) C(MADV_SEQUENTIAL) C(MADV_WILLNEED) C(MADV_DONTNEED) C(MADV_REMOVE)
  C(MADV_DONTFORK) C(MADV_DOFORK) C(MADV_MERGEABLE) C(MADV_UNMERGEABLE) C(MADV_HUGEPAGE)
  C(MADV_NOHUGEPAGE) C(MADV_DONTDUMP) C(MADV_DODUMP) C(MADV_FREE) C(MADV_WIPEONFORK) C(MADV_KEEPONFORK)
#ifdef MADV_COLD
  C(MADV_COLD) C(MADV_PAGEOUT)
#endif
#ifdef MADV_POPULATE_READ
  C(MADV_POPULATE_READ) C(MADV_POPULATE_WRITE)
#endif
  C(MFD_CLOEXEC) C(MFD_ALLOW_SEALING) C(MFD_HUGETLB)
  C(EFD_CLOEXEC) C(EFD_NONBLOCK) C(EFD_SEMAPHORE)
  C(KVM_API_VERSION)
  C(KVM_EXIT_UNKNOWN) C(KVM_EXIT_EXCEPTION) C(KVM_EXIT_IO) C(KVM_EXIT_HYPERCALL) C(KVM_EXIT_DEBUG)
  C(KVM_EXIT_HLT) C(KVM_EXIT_MMIO) C(KVM_EXIT_IRQ_WINDOW_OPEN) C(KVM_EXIT_SHUTDOWN) C(KVM_EXIT_FAIL_ENTRY)
  C(KVM_EXIT_INTR) C(KVM_EXIT_SET_TPR) C(KVM_EXIT_TPR_ACCESS) C(KVM_EXIT_NMI) C(KVM_EXIT_INTERNAL_ERROR)
  C(KVM_EXIT_SYSTEM_EVENT) C(KVM_EXIT_X86_RDMSR) C(KVM_EXIT_X86_WRMSR)
  C(KVM_EXIT_IO_IN) C(KVM_EXIT_IO_OUT)
  C(KVM_MEM_LOG_DIRTY_PAGES) C(KVM_MEM_READONLY)
  C(KVM_CAP_IRQCHIP) C(KVM_CAP_HLT) C(KVM_CAP_USER_MEMORY) C(KVM_CAP_SET_TSS_ADDR) C(KVM_CAP_EXT_CPUID)
  C(KVM_CAP_NR_VCPUS) C(KVM_CAP_MAX_VCPUS) C(KVM_CAP_NR_MEMSLOTS) C(KVM_CAP_PIT2) C(KVM_CAP_IOEVENTFD)
  C(KVM_CAP_IRQFD) C(KVM_CAP_SYNC_MMU) C(KVM_CAP_SET_IDENTITY_MAP_ADDR) C(KVM_CAP_ADJUST_CLOCK)
  C(KVM_CAP_TSC_DEADLINE_TIMER) C(KVM_CAP_IMMEDIATE_EXIT) C(KVM_CAP_READONLY_MEM) C(KVM_CAP_XSAVE)
  C(KVM_CAP_XCRS) C(KVM_CAP_TSC_CONTROL) C(KVM_CAP_SPLIT_IRQCHIP) C(KVM_CAP_X2APIC_API)
#undef C
  set("KVM_RUN_MMIO_DATA_OFFSET", offsetof(kvm_run, mmio.data));
  set("KVM_RUN_SIZE", sizeof(kvm_run));
  set("PAGE_SIZE", static_cast<double>(sysconf(_SC_PAGESIZE)));
  c.Freeze();
  return c;
}

}  // namespace

bool GetMapping(Napi::Value v, MappingView* out) {
  Mapping* m = TryUnwrap(v);
  if (m == nullptr || !m->state()->mapped) return false;
  out->addr = m->state()->addr;
  out->length = m->state()->length;
  return true;
}

bool IsLiveMappingRange(uintptr_t addr, size_t length) {
  std::lock_guard<std::mutex> l(g_live_mu);
  auto it = g_live.upper_bound(addr);
  if (it == g_live.begin()) return false;
  --it;
  const uintptr_t start = it->first;
  const size_t len = it->second;
  return addr >= start && addr - start <= len && length <= len - (addr - start);
}

void InitSyscalls(Napi::Env env, Napi::Object exports) {
  Napi::Function mapping = Mapping::Define(env);
  {
    std::lock_guard<std::mutex> l(g_ctor_mu);
    g_ctors[env] = new Napi::FunctionReference(Napi::Persistent(mapping));
  }
  env.AddCleanupHook([e = static_cast<napi_env>(env)]() {
    std::lock_guard<std::mutex> l(g_ctor_mu);
    auto it = g_ctors.find(e);
    if (it != g_ctors.end()) {
      delete it->second;
      g_ctors.erase(it);
    }
  });
  exports.Set("Mapping", mapping);

  auto fn = [&](const char* name, Napi::Function::Callback cb) { exports.Set(name, Napi::Function::New(env, cb, name)); };
  fn("openKvm", OpenKvm);
  fn("close", Close);
  fn("memfdCreate", MemfdCreate);
  fn("eventfd", Eventfd);
  fn("ftruncate", Ftruncate);
  fn("mmap", Mmap);
  fn("munmap", Munmap);
  fn("madvise", Madvise);
  fn("kvmGetApiVersion", KvmGetApiVersion);
  fn("kvmCheckExtension", KvmCheckExtension);
  fn("kvmCreateVm", KvmCreateVm);
  fn("kvmGetVcpuMmapSize", KvmGetVcpuMmapSize);
  fn("kvmCreateVcpu", KvmCreateVcpu);
  fn("kvmSetTssAddr", KvmSetTssAddr);
  fn("kvmSetUserMemoryRegion", KvmSetUserMemoryRegion);
  fn("kvmGetRegs", KvmGetRegs);
  fn("kvmSetRegs", KvmSetRegs);
  fn("kvmGetSregs", KvmGetSregs);
  fn("kvmSetSregs", KvmSetSregs);
  fn("kvmRun", KvmRun);
  exports.Set("constants", Constants(env));
}

}  // namespace forkling
