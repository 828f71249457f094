// Node binding of the in-process VMM (native/src/vmm/): `new Vm(options,
// onEvents)` boots a KVM guest; events (console lines, the VM stopping,
// device errors) reach JavaScript batched through one thread-safe function,
// never once per VM exit. `vmmInternals` exposes the loader, the MP table, the
// UART/i8042 models and the PCI/virtio-pci transport over a plain buffer, so
// they are tested without KVM.
#include <napi.h>

#include <malloc.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "errno_error.h"
#include "snapshot_js.h"
#include "vmm/boot_loader.h"
#include "vmm/layout.h"
#include "vmm/legacy_devices.h"
#include "vmm/mptable.h"
#include "vmm/pci.h"
#include "vmm/virtio_pci.h"
#include "vmm/virtio_rng.h"
#include "vmm/vm.h"

namespace forkling {
namespace {

using vmm::VmEvent;

// Events from any thread, delivered to JS in batches: a call is scheduled only
// when none is pending, so a burst of console lines costs one JS call.
class EventQueue {
 public:
  static constexpr size_t kMaxPendingConsole = 10000;

  void Init(Napi::ThreadSafeFunction tsfn) { tsfn_ = tsfn; }

  void Post(VmEvent&& ev) {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    if (ev.type == VmEvent::Type::kConsole) {
      if (console_pending_ >= kMaxPendingConsole) {
        dropped_++;
        return;
      }
      console_pending_++;
    }
    pending_.push_back(std::move(ev));
    if (!scheduled_) {
      scheduled_ = true;
      tsfn_.NonBlockingCall([self = self_.lock()](Napi::Env env, Napi::Function cb) {
        if (self) self->Deliver(env, cb);
      });
    }
  }

  void Deliver(Napi::Env env, Napi::Function cb) {
    std::vector<VmEvent> evs;
    uint64_t dropped;
    {
      std::lock_guard<std::mutex> l(mu_);
      evs.swap(pending_);
      scheduled_ = false;
      console_pending_ = 0;
      dropped = dropped_;
      dropped_ = 0;
    }
    if (evs.empty() && !dropped) return;
    Napi::Array out = Napi::Array::New(env);
    uint32_t n = 0;
    Napi::Array lines;
    for (VmEvent& e : evs) {
      if (e.type == VmEvent::Type::kConsole) {
        if (lines.IsEmpty()) {
          Napi::Object o = Napi::Object::New(env);
          lines = Napi::Array::New(env);
          o.Set("type", "console");
          o.Set("lines", lines);
          out.Set(n++, o);
        }
        lines.Set(lines.Length(), Napi::String::New(env, e.line));
        continue;
      }
      lines = Napi::Array();
      Napi::Object o = Napi::Object::New(env);
      if (e.type == VmEvent::Type::kStopped) {
        o.Set("type", "stopped");
        o.Set("reason", e.reason);
      } else {
        o.Set("type", "device-error");
        o.Set("device", e.reason);
      }
      o.Set("message", e.message);
      out.Set(n++, o);
    }
    if (dropped) {
      Napi::Object o = Napi::Object::New(env);
      o.Set("type", "console-dropped");
      o.Set("count", Napi::Number::New(env, double(dropped)));
      out.Set(n++, o);
    }
    cb.Call({out});
  }

  // No more events after this; pending ones are still delivered.
  void Close() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (closed_) return;
      closed_ = true;
    }
    tsfn_.Release();
  }

  std::weak_ptr<EventQueue> self_;

 private:
  std::mutex mu_;
  Napi::ThreadSafeFunction tsfn_;
  std::vector<VmEvent> pending_;
  size_t console_pending_ = 0;
  uint64_t dropped_ = 0;
  bool scheduled_ = false;
  bool closed_ = false;
};

std::string GetString(Napi::Object o, const char* key, bool required) {
  Napi::Value v = o.Get(key);
  if (v.IsUndefined() && !required) return "";
  if (!v.IsString()) throw Napi::TypeError::New(o.Env(), std::string("Vm option ") + key + " must be a string");
  return v.As<Napi::String>().Utf8Value();
}

double GetNumber(Napi::Object o, const char* key, double dflt) {
  Napi::Value v = o.Get(key);
  if (v.IsUndefined()) return dflt;
  if (!v.IsNumber()) throw Napi::TypeError::New(o.Env(), std::string("Vm option ") + key + " must be a number");
  return v.As<Napi::Number>().DoubleValue();
}

// Marks the JS objects that are a VmWrap, so that one passed as an argument can be unwrapped safely.
const napi_type_tag kVmTypeTag = {0x666f726b6c696e67ULL, 0x766d777261707631ULL};

class VmWrap : public Napi::ObjectWrap<VmWrap> {
 public:
  // The live VM of a Vm object passed to another Vm's method; throws for anything else or a killed VM.
  static vmm::Vm& Of(Napi::Value v) {
    if (!v.IsObject() || !v.As<Napi::Object>().CheckTypeTag(&kVmTypeTag)) throw std::invalid_argument("not a Vm");
    VmWrap* w = Unwrap(v.As<Napi::Object>());
    if (!w->vm_) throw std::runtime_error("that VM was killed");
    return *w->vm_;
  }
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "Vm",
                       {InstanceMethod("start", &VmWrap::Start), InstanceMethod("pause", &VmWrap::Pause),
                        InstanceMethod("resume", &VmWrap::Resume), InstanceMethod("doze", &VmWrap::Doze),
                        InstanceMethod("dozing", &VmWrap::Dozing),
                        InstanceMethod("kill", &VmWrap::Kill),
                        InstanceMethod("stats", &VmWrap::Stats), InstanceMethod("debugState", &VmWrap::DebugState),
                        InstanceMethod("flushEvents", &VmWrap::FlushEvents),
                        // Snapshots (snapshot_binding.cc).
                        InstanceMethod("saveTemplate", &VmWrap::SaveTemplate),
                        InstanceMethod("branch", &VmWrap::Branch),
                        InstanceMethod("memoryUsage", &VmWrap::MemoryUsage),
                        InstanceMethod("reclaim", &VmWrap::Reclaim),
                        InstanceMethod("pack", &VmWrap::Pack),
                        InstanceMethod("capturePattern", &VmWrap::CapturePattern),
                        InstanceMethod("setPattern", &VmWrap::SetPattern),
                        InstanceMethod("guestBytes", &VmWrap::GuestBytes),
                        InstanceMethod("writeGuestBytes", &VmWrap::WriteGuestBytes)});
  }

  VmWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<VmWrap>(info) {
    Napi::Env env = info.Env();
    info.This().As<Napi::Object>().TypeTag(&kVmTypeTag);  // (VmOf: another method's Vm argument)
    if (info.Length() < 2 || !info[0].IsObject() || !info[1].IsFunction())
      throw Napi::TypeError::New(env, "new Vm(options, onEvents)");
    Napi::Object o = info[0].As<Napi::Object>();
    // A VM already created and restored off the JS thread (snapshot.prepareVms).
    if (!o.Get("prepared").IsUndefined()) {
      std::unique_ptr<PreparedVm> p = TakePreparedVm(o.Get("prepared"));
      p->events->SetTarget(ListenEvents(env, info[1].As<Napi::Function>()));
      vm_ = std::move(p->vm);
      return;
    }
    vmm::VmConfig cfg;
    // A restored VM (a fork or branch child) takes RAM and state from a snapshot.
    std::shared_ptr<const vmm::RestoreSpec> restore;
    if (!o.Get("restore").IsUndefined()) restore = RestoreSpecOf(o.Get("restore"));
    cfg.kernel_path = GetString(o, "kernel", !restore);
    cfg.initrd_path = GetString(o, "initrd", false);
    cfg.cmdline = GetString(o, "cmdline", false);
    cfg.vsock_path = GetString(o, "vsockPath", false);
    double mib = GetNumber(o, "memoryMiB", 512);
    double vcpus = GetNumber(o, "vcpus", 1);
    double cid = GetNumber(o, "vsockCid", 3);
    if (!(mib >= 32 && mib <= (1 << 20)) || mib != double(uint64_t(mib)))
      throw Napi::RangeError::New(env, "memoryMiB must be a whole number between 32 and 1048576");
    if (!(vcpus >= 1 && vcpus <= vmm::kMaxVcpus) || vcpus != double(uint32_t(vcpus)))
      throw Napi::RangeError::New(env, "vcpus must be a whole number between 1 and " + std::to_string(vmm::kMaxVcpus));
    cfg.memory_bytes = uint64_t(mib) << 20;
    cfg.vcpus = uint32_t(vcpus);
    if (restore) {
      cfg.memory_bytes = restore->memory_bytes;
      cfg.vcpus = restore->vcpus;
    }
    cfg.vsock_cid = uint64_t(cid);
    Napi::Value rng = o.Get("rng");
    cfg.rng = rng.IsUndefined() ? true : rng.ToBoolean().Value();

    vmm::Vm::EventFn post = ListenEvents(env, info[1].As<Napi::Function>());
    try {
      vm_ = restore ? std::make_unique<vmm::Vm>(cfg, post, restore) : std::make_unique<vmm::Vm>(cfg, post);
    } catch (const std::system_error& e) {
      events_->Close();
      Napi::Error err = ErrnoError(env, e.what(), e.code().value());
      err.Set("message", Napi::String::New(env, e.what()));
      throw err;
    } catch (const std::exception& e) {
      events_->Close();
      throw Napi::Error::New(env, e.what());
    }
  }

  ~VmWrap() override {
    if (vm_) vm_->Kill();
    if (events_) events_->Close();
  }

 private:
  vmm::Vm& Live(Napi::Env env) {
    if (!vm_) throw Napi::Error::New(env, "this VM was killed");
    return *vm_;
  }
  // The VM's events go to onEvents: in batches from any thread, or now (flushEvents).
  vmm::Vm::EventFn ListenEvents(Napi::Env env, Napi::Function on_events) {
    on_events_ = Napi::Persistent(on_events);
    events_ = std::make_shared<EventQueue>();
    events_->self_ = events_;
    events_->Init(Napi::ThreadSafeFunction::New(env, on_events, "forkling-vm-events", 0, 1));
    std::shared_ptr<EventQueue> q = events_;
    return [q](VmEvent&& e) { q->Post(std::move(e)); };
  }
  // Delivers the events posted so far now, on this thread (onEvents runs before
  // this returns): a VM that stops posts why before its device closes the host's
  // connections, so whoever sees such a close can learn why at once.
  Napi::Value FlushEvents(const Napi::CallbackInfo& info) {
    std::shared_ptr<EventQueue> q = events_;  // (onEvents may kill the VM meanwhile)
    if (q && !on_events_.IsEmpty()) q->Deliver(info.Env(), on_events_.Value());
    return info.Env().Undefined();
  }
  Napi::Value Start(const Napi::CallbackInfo& info) {
    Live(info.Env()).Start();
    return info.Env().Undefined();
  }
  Napi::Value Pause(const Napi::CallbackInfo& info) {
    Live(info.Env()).Pause();
    return info.Env().Undefined();
  }
  Napi::Value Resume(const Napi::CallbackInfo& info) {
    Live(info.Env()).Resume();
    return info.Env().Undefined();
  }
  Napi::Value Doze(const Napi::CallbackInfo& info) {
    return Napi::Boolean::New(info.Env(), Live(info.Env()).Doze());
  }
  Napi::Value Dozing(const Napi::CallbackInfo& info) {
    return Napi::Boolean::New(info.Env(), Live(info.Env()).dozing());
  }
  // Joins the vCPU and device threads and frees guest RAM; idempotent.
  Napi::Value Kill(const Napi::CallbackInfo& info) {
    if (vm_) {
      vm_->Kill();
      vm_.reset();
    }
    if (events_) events_->Close();
    return info.Env().Undefined();
  }
  Napi::Value SaveTemplate(const Napi::CallbackInfo& info) { return VmSaveTemplate(info, Live(info.Env())); }
  Napi::Value Branch(const Napi::CallbackInfo& info) { return VmBranch(info, Live(info.Env())); }
  Napi::Value MemoryUsage(const Napi::CallbackInfo& info) { return VmMemoryUsage(info, Live(info.Env())); }
  Napi::Value Reclaim(const Napi::CallbackInfo& info) { return VmReclaim(info, Live(info.Env())); }
  Napi::Value Pack(const Napi::CallbackInfo& info) { return VmPack(info, Live(info.Env())); }
  Napi::Value CapturePattern(const Napi::CallbackInfo& info) { return VmCapturePattern(info, Live(info.Env())); }
  Napi::Value SetPattern(const Napi::CallbackInfo& info) { return VmSetPattern(info, Live(info.Env())); }
  Napi::Value GuestBytes(const Napi::CallbackInfo& info) { return VmGuestBytes(info, Live(info.Env())); }
  Napi::Value WriteGuestBytes(const Napi::CallbackInfo& info) { return VmWriteGuestBytes(info, Live(info.Env())); }
  Napi::Value DebugState(const Napi::CallbackInfo& info) {
    return Napi::String::New(info.Env(), Live(info.Env()).DebugState());
  }
  Napi::Value Stats(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    vmm::Vm::Stats s = Live(env).GetStats();
    Napi::Object o = Napi::Object::New(env);
    o.Set("memoryBytes", Napi::Number::New(env, double(s.memory_bytes)));
    o.Set("residentBytes", Napi::Number::New(env, double(s.resident_bytes)));
    Napi::Object c = Napi::Object::New(env);
    for (const auto& [k, v] : s.counters) c.Set(k, Napi::Number::New(env, double(v)));
    o.Set("counters", c);
    return o;
  }

  std::unique_ptr<vmm::Vm> vm_;
  std::shared_ptr<EventQueue> events_;
  Napi::FunctionReference on_events_;  // (flushEvents)
};

// ---- vmmInternals: the pure parts, over JS buffers -------------------------

vmm::GuestMemory MemoryOf(Napi::Value v) {
  if (!v.IsBuffer()) throw Napi::TypeError::New(v.Env(), "guest memory must be a Buffer");
  auto b = v.As<Napi::Buffer<uint8_t>>();
  return vmm::GuestMemory(b.Data(), b.Length());
}

Napi::Value ParseKernelJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsBuffer()) throw Napi::TypeError::New(env, "parseKernel(buffer)");
  auto b = info[0].As<Napi::Buffer<uint8_t>>();
  vmm::KernelInfo k;
  std::string err;
  if (!vmm::ParseKernel(b.Data(), b.Length(), &k, &err)) throw Napi::Error::New(env, err);
  Napi::Object o = Napi::Object::New(env);
  bool bz = k.kind == vmm::KernelInfo::Kind::kBzImage;
  o.Set("kind", bz ? "bzImage" : "elf");
  if (bz) {
    o.Set("protocol", k.protocol);
    o.Set("setupSects", k.setup_sects);
    o.Set("payloadOffset", double(k.payload_offset));
    o.Set("payloadSize", double(k.payload_size));
    o.Set("xloadflags", k.xloadflags);
    o.Set("relocatable", k.relocatable);
    o.Set("kernelAlignment", k.kernel_alignment);
    o.Set("prefAddress", double(k.pref_address));
    o.Set("initSize", k.init_size);
    o.Set("headerEnd", k.header_end);
  } else {
    o.Set("entry", double(k.elf_entry));
    Napi::Array segs = Napi::Array::New(env);
    for (size_t i = 0; i < k.segments.size(); i++) {
      Napi::Object s = Napi::Object::New(env);
      s.Set("paddr", double(k.segments[i].paddr));
      s.Set("filesz", double(k.segments[i].filesz));
      s.Set("memsz", double(k.segments[i].memsz));
      segs.Set(uint32_t(i), s);
    }
    o.Set("segments", segs);
  }
  o.Set("cmdlineSize", k.cmdline_size);
  o.Set("initrdAddrMax", k.initrd_addr_max);
  return o;
}

// loadLinux(memory, kernel, cmdline, initrdSize, vcpus): everything the VM
// does before its first KVM_RUN, into `memory` (a Buffer as guest RAM at 0).
Napi::Value LoadLinuxJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 5 || !info[1].IsBuffer() || !info[2].IsString() || !info[3].IsNumber() || !info[4].IsNumber())
    throw Napi::TypeError::New(env, "loadLinux(memory, kernel, cmdline, initrdSize, vcpus)");
  vmm::GuestMemory mem = MemoryOf(info[0]);
  auto kb = info[1].As<Napi::Buffer<uint8_t>>();
  std::string cmdline = info[2].As<Napi::String>().Utf8Value();
  uint64_t initrd_size = uint64_t(info[3].As<Napi::Number>().DoubleValue());
  uint32_t vcpus = info[4].As<Napi::Number>().Uint32Value();
  vmm::KernelInfo k;
  vmm::LoadedKernel lk;
  std::string err;
  if (!vmm::ParseKernel(kb.Data(), kb.Length(), &k, &err) || !vmm::LoadKernel(mem, kb.Data(), kb.Length(), k, &lk, &err))
    throw Napi::Error::New(env, err);
  uint64_t initrd_addr = 0;
  if (initrd_size) {
    initrd_addr = vmm::PlaceInitrd(k, mem.size() < vmm::layout::kPciHole ? mem.size() : vmm::layout::kPciHole, lk.end,
                                   initrd_size);
    if (!initrd_addr) throw Napi::Error::New(env, "initrd does not fit");
  }
  if (!vmm::WriteBootParams(mem, kb.Data(), kb.Length(), k, cmdline, initrd_addr, initrd_size,
                            vmm::BuildE820(mem.size()), &err) ||
      !vmm::WriteBootPageTablesAndGdt(mem, &err) || !vmm::WriteMpTable(mem, vmm::layout::kEbda, vcpus, &err))
    throw Napi::Error::New(env, err);
  Napi::Object o = Napi::Object::New(env);
  o.Set("entry", double(lk.entry));
  o.Set("kernelEnd", double(lk.end));
  o.Set("initrdAddr", double(initrd_addr));
  return o;
}

Napi::Value E820Js(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  auto e = vmm::BuildE820(uint64_t(info[0].As<Napi::Number>().DoubleValue()));
  Napi::Array a = Napi::Array::New(env);
  for (size_t i = 0; i < e.size(); i++) {
    Napi::Object o = Napi::Object::New(env);
    o.Set("addr", double(e[i].addr));
    o.Set("size", double(e[i].size));
    o.Set("type", e[i].type);
    a.Set(uint32_t(i), o);
  }
  return a;
}

Napi::Value WriteMpTableJs(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  vmm::GuestMemory mem = MemoryOf(info[0]);
  std::string err;
  if (!vmm::WriteMpTable(mem, uint64_t(info[1].As<Napi::Number>().DoubleValue()), info[2].As<Napi::Number>().Uint32Value(),
                         &err))
    throw Napi::Error::New(env, err);
  return Napi::Number::New(env, double(vmm::MpTableSize(info[2].As<Napi::Number>().Uint32Value())));
}

// A UART with its interrupt pulses counted and its output collected.
class UartWrap : public Napi::ObjectWrap<UartWrap> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "Uart", {InstanceMethod("read", &UartWrap::Read), InstanceMethod("write", &UartWrap::Write),
                                     InstanceMethod("input", &UartWrap::Input),
                                     InstanceAccessor("irqs", &UartWrap::Irqs, nullptr),
                                     InstanceMethod("takeOutput", &UartWrap::TakeOutput)});
  }
  UartWrap(const Napi::CallbackInfo& info)
      : Napi::ObjectWrap<UartWrap>(info), uart_([this] { irqs_++; }, [this](uint8_t b) { out_.push_back(char(b)); }) {}

 private:
  Napi::Value Read(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), uart_.Read(uint8_t(info[0].As<Napi::Number>().Uint32Value())));
  }
  Napi::Value Write(const Napi::CallbackInfo& info) {
    uart_.Write(uint8_t(info[0].As<Napi::Number>().Uint32Value()), uint8_t(info[1].As<Napi::Number>().Uint32Value()));
    return info.Env().Undefined();
  }
  Napi::Value Input(const Napi::CallbackInfo& info) {
    auto b = info[0].As<Napi::Buffer<uint8_t>>();
    uart_.Input(b.Data(), b.Length());
    return info.Env().Undefined();
  }
  Napi::Value Irqs(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), irqs_); }
  Napi::Value TakeOutput(const Napi::CallbackInfo& info) {
    Napi::Value v = Napi::String::New(info.Env(), out_);
    out_.clear();
    return v;
  }
  uint32_t irqs_ = 0;
  std::string out_;
  vmm::Uart8250 uart_;
};

class I8042Wrap : public Napi::ObjectWrap<I8042Wrap> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "I8042", {InstanceMethod("read", &I8042Wrap::Read), InstanceMethod("write", &I8042Wrap::Write),
                                      InstanceAccessor("resets", &I8042Wrap::Resets, nullptr)});
  }
  I8042Wrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<I8042Wrap>(info), dev_([this] { resets_++; }) {}

 private:
  Napi::Value Read(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), dev_.Read(uint16_t(info[0].As<Napi::Number>().Uint32Value())));
  }
  Napi::Value Write(const Napi::CallbackInfo& info) {
    dev_.Write(uint16_t(info[0].As<Napi::Number>().Uint32Value()), uint8_t(info[1].As<Napi::Number>().Uint32Value()));
    return info.Env().Undefined();
  }
  Napi::Value Resets(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), resets_); }
  uint32_t resets_ = 0;
  vmm::I8042 dev_;
};

// A PCI bus with a virtio-rng behind virtio-pci, over a Buffer as guest RAM:
// port I/O to 0xCF8-0xCFF, MMIO to the BAR, MSI messages recorded.
class PciWrap : public Napi::ObjectWrap<PciWrap> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "PciModel",
                       {InstanceMethod("ioRead", &PciWrap::IoRead), InstanceMethod("ioWrite", &PciWrap::IoWrite),
                        InstanceMethod("mmioRead", &PciWrap::MmioRead), InstanceMethod("mmioWrite", &PciWrap::MmioWrite),
                        InstanceMethod("takeMsis", &PciWrap::TakeMsis), InstanceMethod("takeErrors", &PciWrap::TakeErrors),
                        InstanceAccessor("barAddress", &PciWrap::BarAddr, nullptr)});
  }
  PciWrap(const Napi::CallbackInfo& info) : Napi::ObjectWrap<PciWrap>(info) {
    mem_ref_ = Napi::Persistent(info[0].As<Napi::Object>());
    vmm::GuestMemory mem = MemoryOf(info[0]);
    bar_ = bus_.AllocateMmio(vmm::VirtioPciDevice::kBarSize);
    auto self = this;
    dev_ = std::make_shared<vmm::VirtioPciDevice>(
        std::make_shared<vmm::VirtioRng>(), mem, bar_,
        [self](uint64_t a, uint32_t d) {
          std::lock_guard<std::mutex> l(self->mu_);
          self->msis_.push_back({a, d});
        },
        [self](const std::string& m) {
          std::lock_guard<std::mutex> l(self->mu_);
          self->errors_.push_back(m);
        });
    bus_.Add(dev_);
  }
  ~PciWrap() override { dev_->Reset(); }

 private:
  Napi::Value IoRead(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), bus_.IoRead(uint16_t(info[0].As<Napi::Number>().Uint32Value()),
                                                     info[1].As<Napi::Number>().Uint32Value()));
  }
  Napi::Value IoWrite(const Napi::CallbackInfo& info) {
    bus_.IoWrite(uint16_t(info[0].As<Napi::Number>().Uint32Value()), info[1].As<Napi::Number>().Uint32Value(),
                 info[2].As<Napi::Number>().Uint32Value());
    return info.Env().Undefined();
  }
  Napi::Value MmioRead(const Napi::CallbackInfo& info) {
    uint64_t addr = uint64_t(info[0].As<Napi::Number>().DoubleValue());
    uint32_t len = info[1].As<Napi::Number>().Uint32Value();
    if (len == 0 || len > 8) throw Napi::RangeError::New(info.Env(), "len 1..8");
    uint8_t d[8];
    if (!bus_.MmioRead(addr, d, len)) return info.Env().Null();
    return Napi::Buffer<uint8_t>::Copy(info.Env(), d, len);
  }
  Napi::Value MmioWrite(const Napi::CallbackInfo& info) {
    uint64_t addr = uint64_t(info[0].As<Napi::Number>().DoubleValue());
    auto b = info[1].As<Napi::Buffer<uint8_t>>();
    if (b.Length() == 0 || b.Length() > 8) throw Napi::RangeError::New(info.Env(), "len 1..8");
    return Napi::Boolean::New(info.Env(), bus_.MmioWrite(addr, b.Data(), uint32_t(b.Length())));
  }
  Napi::Value TakeMsis(const Napi::CallbackInfo& info) {
    std::lock_guard<std::mutex> l(mu_);
    Napi::Array a = Napi::Array::New(info.Env());
    for (size_t i = 0; i < msis_.size(); i++) {
      Napi::Object o = Napi::Object::New(info.Env());
      o.Set("address", double(msis_[i].first));
      o.Set("data", msis_[i].second);
      a.Set(uint32_t(i), o);
    }
    msis_.clear();
    return a;
  }
  Napi::Value TakeErrors(const Napi::CallbackInfo& info) {
    std::lock_guard<std::mutex> l(mu_);
    Napi::Array a = Napi::Array::New(info.Env());
    for (size_t i = 0; i < errors_.size(); i++) a.Set(uint32_t(i), errors_[i]);
    errors_.clear();
    return a;
  }
  Napi::Value BarAddr(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), double(bar_)); }

  Napi::ObjectReference mem_ref_;  // keeps the guest-RAM Buffer alive
  vmm::PciBus bus_;
  uint64_t bar_ = 0;
  std::shared_ptr<vmm::VirtioPciDevice> dev_;
  std::mutex mu_;
  std::vector<std::pair<uint64_t, uint32_t>> msis_;
  std::vector<std::string> errors_;
};

}  // namespace

vmm::Vm& VmOf(Napi::Value v) { return VmWrap::Of(v); }

void InitVmm(Napi::Env env, Napi::Object exports) {
  exports.Set("Vm", VmWrap::Define(env));
  Napi::Object t = Napi::Object::New(env);
  t.Set("parseKernel", Napi::Function::New(env, ParseKernelJs, "parseKernel"));
  t.Set("loadLinux", Napi::Function::New(env, LoadLinuxJs, "loadLinux"));
  t.Set("e820", Napi::Function::New(env, E820Js, "e820"));
  t.Set("writeMpTable", Napi::Function::New(env, WriteMpTableJs, "writeMpTable"));
  // Bytes malloc has handed out and not had back, in all arenas (benchmarks: the VMM's C++
  // objects per VM, which no other figure counts).
  t.Set("mallocInUse", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    const struct mallinfo2 m = mallinfo2();
    return Napi::Number::New(info.Env(), double(m.uordblks + m.hblkhd));
  }, "mallocInUse"));
  t.Set("Uart", UartWrap::Define(env));
  t.Set("I8042", I8042Wrap::Define(env));
  t.Set("PciModel", PciWrap::Define(env));
  Napi::Object layout = Napi::Object::New(env);
  layout.Set("bootParams", double(vmm::layout::kBootParams));
  layout.Set("cmdline", double(vmm::layout::kCmdline));
  layout.Set("pml4", double(vmm::layout::kPml4));
  layout.Set("gdt", double(vmm::layout::kGdt));
  layout.Set("ebda", double(vmm::layout::kEbda));
  layout.Set("pciMmioBase", double(vmm::layout::kPciMmioBase));
  t.Set("layout", layout);
  exports.Set("vmmInternals", t);
}

}  // namespace forkling
