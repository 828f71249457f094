// Test-only binding: the virtio device models driven without KVM. Guest RAM
// is an anonymous mapping shown to JavaScript as an ArrayBuffer (`memory`);
// a TypeScript "fake driver" lays out rings in it, activates the device with
// queue addresses and kicks it, exactly as a guest would through the
// transport. Everything JavaScript passes is checked, so a test can feed any
// hostile layout without crashing the process.
//
//   new vmmTesting.VirtioTestDevice('rng' | 'vsock', {
//     memorySize, regions?: [gpa, size][], guestCid?, socketPath?,
//     onEvent?: (kind: 'interrupt' | 'failure', value: number | string) => void })
//
// And guest RAM mapped from a file as a restored VM maps it, read through the
// checked accessors that device models use (the SIGBUS guard, vmm/ram_guard.h):
//
//   new vmmTesting.GuestRamProbe(path, size): read(gpa, len) -> Buffer | null,
//     lost() -> boolean, close()
//
// And the bookkeeping of a VM's pattern runs (vmm/snapshot/pattern.h), no
// pattern file needed: which pages are mapped from it, how many mappings that
// costs, and the budget all VMs of the process share:
//
//   new vmmTesting.PatternBackingProbe(): add(first, count), remove(first, count),
//     has(page), pages() -> number[], maps(), mapsLeft(), exhaust(), close();
//     vmmTesting.patternMapsInProcess()
//
// And packing (vmm/snapshot/packed_pages.h) without a VM:
//
//   vmmTesting.packRoundTrip(pages, bases, ramPages?) -> {added, packedPages,
//     encodedBytes, hostBytes, applied, restored}
//
// And the zero-run squeeze of a shelved VM's state (vmm/snapshot/zero_runs.h):
//
//   vmmTesting.squeezeZeros(bytes) -> Buffer; vmmTesting.expandZeros(bytes, maxBytes) -> Buffer
#include <napi.h>
#include <sys/mman.h>

#include <memory>
#include <stdexcept>
#include <system_error>

#include "errno_error.h"
#include "js_uint.h"
#include "vmm/guest_ram.h"
#include "vmm/park_watch.h"
#include "vmm/snapshot/packed_pages.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/snapshot/state_file.h"
#include "vmm/snapshot/zero_runs.h"
#include "vmm/virtio_rng.h"
#include "vmm/virtio_vsock.h"

namespace forkling {
namespace {

using vmm::GuestMemory;
using vmm::QueueConfig;
using vmm::VirtioDevice;
using vmm::VirtioVsock;

constexpr uint64_t kMaxTestRam = 1ull << 30;

// Owned jointly by the device wrapper and the ArrayBuffer, so neither a GC'd
// (or transferred) buffer nor a closed device leaves the other dangling.
struct TestRam {
  uint8_t* p = nullptr;
  size_t n = 0;
  ~TestRam() {
    if (p) munmap(p, n);
  }
};

struct DeviceEvent {
  bool failure;
  uint16_t queue;
  std::string message;
};

uint64_t ToUint(Napi::Env env, const Napi::Value& v, const char* what, uint64_t max) {
  if (!v.IsNumber()) throw Napi::TypeError::New(env, std::string(what) + " must be a number");
  uint64_t x = ToU64(env, v, what);
  if (x > max) throw Napi::RangeError::New(env, std::string(what) + " must be at most " + std::to_string(max));
  return x;
}

class VirtioTestDevice : public Napi::ObjectWrap<VirtioTestDevice> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "VirtioTestDevice",
                       {
                           InstanceMethod<&VirtioTestDevice::DeviceId>("deviceId"),
                           InstanceMethod<&VirtioTestDevice::DeviceFeatures>("deviceFeatures"),
                           InstanceMethod<&VirtioTestDevice::NumQueues>("numQueues"),
                           InstanceMethod<&VirtioTestDevice::MaxQueueSize>("maxQueueSize"),
                           InstanceMethod<&VirtioTestDevice::ReadConfig>("readConfig"),
                           InstanceMethod<&VirtioTestDevice::WriteConfig>("writeConfig"),
                           InstanceMethod<&VirtioTestDevice::Activate>("activate"),
                           InstanceMethod<&VirtioTestDevice::Notify>("notify"),
                           InstanceMethod<&VirtioTestDevice::Reset>("reset"),
                           InstanceMethod<&VirtioTestDevice::TransportReset>("transportReset"),
                           InstanceMethod<&VirtioTestDevice::Sync>("sync"),
                           InstanceMethod<&VirtioTestDevice::Failure>("failure"),
                           InstanceMethod<&VirtioTestDevice::Stats>("stats"),
                           InstanceMethod<&VirtioTestDevice::Pause>("pause"),
                           InstanceMethod<&VirtioTestDevice::Resume>("resume"),
                           InstanceMethod<&VirtioTestDevice::RequestPark>("requestPark"),
                           InstanceMethod<&VirtioTestDevice::SaveState>("saveState"),
                           InstanceMethod<&VirtioTestDevice::RestoreState>("restoreState"),
                           InstanceMethod<&VirtioTestDevice::Close>("close"),
                       });
  }

  explicit VirtioTestDevice(const Napi::CallbackInfo& info) : Napi::ObjectWrap<VirtioTestDevice>(info) {
    Napi::Env env = info.Env();
    if (info.Length() < 2 || !info[0].IsString() || !info[1].IsObject())
      throw Napi::TypeError::New(env, "usage: new VirtioTestDevice('rng' | 'vsock', options)");
    const std::string kind = info[0].As<Napi::String>();
    Napi::Object opts = info[1].As<Napi::Object>();

    const uint64_t size = ToUint(env, opts.Get("memorySize"), "memorySize", kMaxTestRam);
    if (size < 4096 || size % 4096 != 0)
      throw Napi::RangeError::New(env, "memorySize must be a multiple of 4096 between 4096 and 1 GiB");
    ram_ = std::make_shared<TestRam>();
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw ErrnoError(env, "mmap", errno);
    ram_->p = static_cast<uint8_t*>(p);
    ram_->n = size;

    Napi::Value regions = opts.Get("regions");
    if (regions.IsUndefined()) {
      mem_ = GuestMemory(ram_->p, size);
    } else {
      if (!regions.IsArray()) throw Napi::TypeError::New(env, "regions must be an array of [gpa, size] pairs");
      Napi::Array arr = regions.As<Napi::Array>();
      for (uint32_t i = 0; i < arr.Length(); i++) {
        Napi::Value r = arr.Get(i);
        if (!r.IsArray() || r.As<Napi::Array>().Length() != 2)
          throw Napi::TypeError::New(env, "regions must be an array of [gpa, size] pairs");
        uint64_t gpa = ToUint(env, r.As<Napi::Array>().Get(0u), "region gpa", size);
        uint64_t len = ToUint(env, r.As<Napi::Array>().Get(1u), "region size", size);
        // In this test RAM a region's host bytes are the buffer at offset gpa.
        if (len > size - gpa || !mem_.AddRegion(gpa, ram_->p + gpa, len))
          throw Napi::RangeError::New(env, "region " + std::to_string(i) + " is empty, overlaps or leaves the buffer");
      }
    }

    Napi::Value on_event = opts.Get("onEvent");
    if (!on_event.IsUndefined()) {
      if (!on_event.IsFunction()) throw Napi::TypeError::New(env, "onEvent must be a function");
      tsfn_ = Napi::ThreadSafeFunction::New(env, on_event.As<Napi::Function>(), "forkling virtio test device", 0, 1);
      has_tsfn_ = true;
    }

    try {
      if (kind == "rng") {
        dev_ = std::make_unique<vmm::VirtioRng>();
      } else if (kind == "vsock") {
        Napi::Value path = opts.Get("socketPath");
        if (!path.IsString()) throw Napi::TypeError::New(env, "socketPath must be a string");
        uint64_t cid = ToU64(env, opts.Get("guestCid"), "guestCid");
        auto v = std::make_shared<VirtioVsock>(cid, path.As<Napi::String>().Utf8Value());  // (shared: it may park)
        vsock_ = v.get();
        dev_ = std::move(v);
      } else {
        throw Napi::TypeError::New(env, "device kind must be 'rng' or 'vsock'");
      }
    } catch (const std::system_error& e) {
      ReleaseCallback();
      throw ErrnoError(env, e.what(), e.code().value());
    } catch (const std::invalid_argument& e) {
      ReleaseCallback();
      throw Napi::RangeError::New(env, e.what());
    } catch (...) {
      ReleaseCallback();
      throw;
    }
    if (has_tsfn_) {
      Napi::ThreadSafeFunction tsfn = tsfn_;
      dev_->set_failure_callback([tsfn](const std::string& msg) mutable {
        tsfn.NonBlockingCall(new DeviceEvent{true, 0, msg}, CallJs);
      });
    }

    auto* hint = new std::shared_ptr<TestRam>(ram_);
    Napi::ArrayBuffer ab = Napi::ArrayBuffer::New(
        env, ram_->p, size, [](Napi::Env, void*, std::shared_ptr<TestRam>* h) { delete h; }, hint);
    info.This().As<Napi::Object>().DefineProperty(Napi::PropertyDescriptor::Value("memory", ab, napi_enumerable));
  }

  ~VirtioTestDevice() override { Shutdown(); }

 private:
  static void CallJs(Napi::Env env, Napi::Function cb, DeviceEvent* ev) {
    std::unique_ptr<DeviceEvent> owned(ev);
    if (env == nullptr || cb.IsEmpty()) return;
    if (ev->failure)
      cb.Call({Napi::String::New(env, "failure"), Napi::String::New(env, ev->message)});
    else
      cb.Call({Napi::String::New(env, "interrupt"), Napi::Number::New(env, ev->queue)});
  }

  VirtioDevice* Dev(Napi::Env env) {
    if (!dev_) throw Napi::Error::New(env, "the test device is closed");
    return dev_.get();
  }
  VirtioVsock* Vsock(Napi::Env env) {
    Dev(env);
    if (!vsock_) throw Napi::TypeError::New(env, "not a vsock device");
    return vsock_;
  }

  void ReleaseCallback() {
    if (has_tsfn_) {
      tsfn_.Release();
      has_tsfn_ = false;
    }
  }

  // Stops the device (joining its thread) before the callback goes away.
  void Shutdown() {
    if (dev_) {
      dev_->Reset();
      dev_.reset();
      vsock_ = nullptr;
    }
    ReleaseCallback();
  }

  Napi::Value DeviceId(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), Dev(info.Env())->DeviceId());
  }
  Napi::Value DeviceFeatures(const Napi::CallbackInfo& info) {
    return Napi::BigInt::New(info.Env(), Dev(info.Env())->DeviceFeatures());
  }
  Napi::Value NumQueues(const Napi::CallbackInfo& info) {
    return Napi::Number::New(info.Env(), Dev(info.Env())->NumQueues());
  }
  Napi::Value MaxQueueSize(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    uint16_t q = static_cast<uint16_t>(ToUint(env, info[0], "queue", 0xFFFF));
    return Napi::Number::New(env, Dev(env)->MaxQueueSize(q));
  }
  Napi::Value ReadConfig(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    uint32_t off = static_cast<uint32_t>(ToUint(env, info[0], "offset", UINT32_MAX));
    uint32_t len = static_cast<uint32_t>(ToUint(env, info[1], "length", 4096));
    Napi::Uint8Array out = Napi::Uint8Array::New(env, len);
    Dev(env)->ReadConfig(off, out.Data(), len);
    return out;
  }
  Napi::Value WriteConfig(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    uint32_t off = static_cast<uint32_t>(ToUint(env, info[0], "offset", UINT32_MAX));
    if (!info[1].IsTypedArray() || info[1].As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array)
      throw Napi::TypeError::New(env, "data must be a Uint8Array");
    Napi::Uint8Array data = info[1].As<Napi::Uint8Array>();
    std::vector<uint8_t> copy(data.Data(), data.Data() + data.ByteLength());
    Dev(env)->WriteConfig(off, copy.data(), static_cast<uint32_t>(copy.size()));
    return env.Undefined();
  }
  Napi::Value Activate(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    VirtioDevice* dev = Dev(env);
    if (!info[0].IsArray()) throw Napi::TypeError::New(env, "queues must be an array");
    Napi::Array arr = info[0].As<Napi::Array>();
    if (arr.Length() > 16) throw Napi::RangeError::New(env, "at most 16 queues");
    std::vector<QueueConfig> queues;
    for (uint32_t i = 0; i < arr.Length(); i++) {
      Napi::Value v = arr.Get(i);
      if (!v.IsObject()) throw Napi::TypeError::New(env, "each queue must be an object");
      Napi::Object o = v.As<Napi::Object>();
      QueueConfig q;
      q.size = static_cast<uint16_t>(ToUint(env, o.Get("size"), "queue size", 0xFFFF));
      q.ready = o.Get("ready").ToBoolean();
      q.desc = ToU64(env, o.Get("desc"), "queue desc");
      q.driver = ToU64(env, o.Get("driver"), "queue driver");
      q.device = ToU64(env, o.Get("device"), "queue device");
      queues.push_back(q);
    }
    uint64_t features = ToU64(env, info[1], "driverFeatures");
    dev->Activate(mem_, queues, features, MakeNotify());
    return env.Undefined();
  }
  Napi::Value Notify(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    uint16_t q = static_cast<uint16_t>(ToUint(env, info[0], "queue", 0xFFFF));
    Dev(env)->QueueNotify(q);
    return env.Undefined();
  }
  Napi::Value Reset(const Napi::CallbackInfo& info) {
    Dev(info.Env())->Reset();
    return info.Env().Undefined();
  }
  Napi::Value TransportReset(const Napi::CallbackInfo& info) {
    Vsock(info.Env())->TransportReset();
    return info.Env().Undefined();
  }
  // Waits (blocking, bounded) until the device has handled everything before
  // the call. The rng works synchronously, so it is always in sync.
  Napi::Value Sync(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    VirtioDevice* dev = Dev(env);
    uint64_t ms = info[0].IsUndefined() ? 5000 : ToUint(env, info[0], "timeoutMs", 60000);
    bool ok = vsock_ ? vsock_->Sync(static_cast<int>(ms)) : (static_cast<void>(dev), true);
    return Napi::Boolean::New(env, ok);
  }
  Napi::Value Failure(const Napi::CallbackInfo& info) {
    VirtioDevice* dev = Dev(info.Env());
    if (!dev->failed()) return info.Env().Null();
    return Napi::String::New(info.Env(), dev->failure());
  }
  Napi::Value Stats(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    VirtioVsock::Stats s = Vsock(env)->stats();
    Napi::Object o = Napi::Object::New(env);
    o.Set("txPackets", Napi::Number::New(env, static_cast<double>(s.tx_packets)));
    o.Set("rxPackets", Napi::Number::New(env, static_cast<double>(s.rx_packets)));
    o.Set("badPackets", Napi::Number::New(env, static_cast<double>(s.bad_packets)));
    o.Set("resetsSent", Napi::Number::New(env, static_cast<double>(s.resets_sent)));
    o.Set("droppedControl", Napi::Number::New(env, static_cast<double>(s.dropped_control)));
    o.Set("connections", Napi::Number::New(env, static_cast<double>(s.connections)));
    o.Set("parked", Napi::Boolean::New(env, s.parked != 0));
    o.Set("parks", Napi::Number::New(env, static_cast<double>(s.parks)));
    o.Set("parkRefusals", Napi::Number::New(env, static_cast<double>(s.park_refusals)));
    o.Set("parkWatched", Napi::Number::New(env, static_cast<double>(vmm::park_watch::Watched())));
    return o;
  }
  Napi::Value RequestPark(const Napi::CallbackInfo& info) {
    Vsock(info.Env())->RequestPark();
    return info.Env().Undefined();
  }
  Napi::Value Pause(const Napi::CallbackInfo& info) {
    Vsock(info.Env())->Pause();
    return info.Env().Undefined();
  }
  Napi::Value Resume(const Napi::CallbackInfo& info) {
    Vsock(info.Env())->Resume();
    return info.Env().Undefined();
  }
  static Napi::Object QueueStateToJs(Napi::Env env, const vmm::Virtqueue::State& q) {
    Napi::Object qo = Napi::Object::New(env);
    qo.Set("size", Napi::Number::New(env, q.config.size));
    qo.Set("ready", Napi::Boolean::New(env, q.config.ready));
    qo.Set("desc", Napi::BigInt::New(env, q.config.desc));
    qo.Set("driver", Napi::BigInt::New(env, q.config.driver));
    qo.Set("device", Napi::BigInt::New(env, q.config.device));
    qo.Set("lastAvail", Napi::Number::New(env, q.last_avail));
    qo.Set("nextUsed", Napi::Number::New(env, q.next_used));
    return qo;
  }
  static vmm::Virtqueue::State QueueStateFromJs(Napi::Env env, const Napi::Value& e) {
    if (!e.IsObject()) throw Napi::TypeError::New(env, "each queue state must be an object");
    Napi::Object q = e.As<Napi::Object>();
    vmm::Virtqueue::State qs;
    qs.config.size = static_cast<uint16_t>(ToUint(env, q.Get("size"), "queue size", 0xFFFF));
    qs.config.ready = q.Get("ready").ToBoolean();
    qs.config.desc = ToU64(env, q.Get("desc"), "queue desc");
    qs.config.driver = ToU64(env, q.Get("driver"), "queue driver");
    qs.config.device = ToU64(env, q.Get("device"), "queue device");
    qs.last_avail = static_cast<uint16_t>(ToUint(env, q.Get("lastAvail"), "lastAvail", 0xFFFF));
    qs.next_used = static_cast<uint16_t>(ToUint(env, q.Get("nextUsed"), "nextUsed", 0xFFFF));
    return qs;
  }
  VirtioDevice::NotifyGuest MakeNotify() {
    if (!has_tsfn_) return nullptr;
    Napi::ThreadSafeFunction tsfn = tsfn_;
    return [tsfn](uint16_t q) mutable { tsfn.NonBlockingCall(new DeviceEvent{false, q, {}}, CallJs); };
  }

  // The snapshot state as a plain object (64-bit values as bigint).
  Napi::Value SaveState(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Dev(env);
    Napi::Object o = Napi::Object::New(env);
    if (!vsock_) {
      vmm::VirtioRng::State st = static_cast<vmm::VirtioRng*>(dev_.get())->SaveState();
      o.Set("active", Napi::Boolean::New(env, st.active));
      o.Set("driverFeatures", Napi::BigInt::New(env, st.driver_features));
      Napi::Array qs = Napi::Array::New(env, 1);
      qs.Set(0u, QueueStateToJs(env, st.queue));
      o.Set("queues", qs);
      return o;
    }
    VirtioVsock::State st = vsock_->SaveState();
    o.Set("guestCid", Napi::BigInt::New(env, st.guest_cid));
    o.Set("active", Napi::Boolean::New(env, st.active));
    o.Set("driverFeatures", Napi::BigInt::New(env, st.driver_features));
    o.Set("nextHostPort", Napi::Number::New(env, st.next_host_port));
    Napi::Array qs = Napi::Array::New(env, 3);
    for (uint32_t i = 0; i < 3; i++) qs.Set(i, QueueStateToJs(env, st.queues[i]));
    o.Set("queues", qs);
    return o;
  }
  Napi::Value RestoreState(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    Dev(env);
    if (!info[0].IsObject()) throw Napi::TypeError::New(env, "state must be an object from saveState()");
    Napi::Object o = info[0].As<Napi::Object>();
    const uint32_t nq = vsock_ ? 3 : 1;
    Napi::Value qv = o.Get("queues");
    if (!qv.IsArray() || qv.As<Napi::Array>().Length() != nq)
      throw Napi::TypeError::New(env, "state.queues must have " + std::to_string(nq) + " entries");
    Napi::Array qa = qv.As<Napi::Array>();
    if (!vsock_) {
      vmm::VirtioRng::State st;
      st.active = o.Get("active").ToBoolean();
      st.driver_features = ToU64(env, o.Get("driverFeatures"), "driverFeatures");
      st.queue = QueueStateFromJs(env, qa.Get(0u));
      static_cast<vmm::VirtioRng*>(dev_.get())->RestoreState(mem_, st, MakeNotify());
      return env.Undefined();
    }
    VirtioVsock::State st;
    st.guest_cid = ToU64(env, o.Get("guestCid"), "guestCid");
    st.active = o.Get("active").ToBoolean();
    st.driver_features = ToU64(env, o.Get("driverFeatures"), "driverFeatures");
    st.next_host_port = static_cast<uint32_t>(ToUint(env, o.Get("nextHostPort"), "nextHostPort", UINT32_MAX));
    for (uint32_t i = 0; i < 3; i++) st.queues[i] = QueueStateFromJs(env, qa.Get(i));
    vsock_->RestoreState(mem_, st, MakeNotify());
    return env.Undefined();
  }
  Napi::Value Close(const Napi::CallbackInfo& info) {
    Shutdown();
    return info.Env().Undefined();
  }

  std::shared_ptr<TestRam> ram_;
  GuestMemory mem_;
  std::shared_ptr<VirtioDevice> dev_;
  VirtioVsock* vsock_ = nullptr;
  Napi::ThreadSafeFunction tsfn_;
  bool has_tsfn_ = false;
};

class GuestRamProbe : public Napi::ObjectWrap<GuestRamProbe> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "GuestRamProbe",
                       {InstanceMethod("read", &GuestRamProbe::Read), InstanceMethod("lost", &GuestRamProbe::Lost),
                        InstanceMethod("close", &GuestRamProbe::Close)});
  }
  explicit GuestRamProbe(const Napi::CallbackInfo& info) : Napi::ObjectWrap<GuestRamProbe>(info) {
    Napi::Env env = info.Env();
    if (info.Length() < 2 || !info[0].IsString()) throw Napi::TypeError::New(env, "GuestRamProbe(path, size)");
    const uint64_t size = ToUint(env, info[1], "size", kMaxTestRam);
    try {
      ram_ = vmm::GuestRam::MapFilePrivate(info[0].As<Napi::String>().Utf8Value(), size);
    } catch (const std::system_error& e) {
      throw Napi::Error::New(env, e.what());
    }
  }

 private:
  Napi::Value Read(const Napi::CallbackInfo& info) {
    Napi::Env env = info.Env();
    const uint64_t gpa = ToUint(env, info[0], "gpa", UINT64_MAX);
    const uint64_t len = ToUint(env, info[1], "len", 1 << 20);
    Napi::Buffer<uint8_t> out = Napi::Buffer<uint8_t>::New(env, len);
    if (!ram_.memory().ReadBytes(gpa, out.Data(), len)) return env.Null();
    return out;
  }
  Napi::Value Lost(const Napi::CallbackInfo& info) { return Napi::Boolean::New(info.Env(), ram_.memory().lost()); }
  Napi::Value Close(const Napi::CallbackInfo& info) {
    ram_.Release();
    return info.Env().Undefined();
  }

  vmm::GuestRam ram_;
};

class PatternBackingProbe : public Napi::ObjectWrap<PatternBackingProbe> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "PatternBackingProbe",
                       {InstanceMethod("add", &PatternBackingProbe::Add), InstanceMethod("remove", &PatternBackingProbe::Remove),
                        InstanceMethod("has", &PatternBackingProbe::Has), InstanceMethod("pages", &PatternBackingProbe::Pages),
                        InstanceMethod("maps", &PatternBackingProbe::Maps), InstanceMethod("mapsLeft", &PatternBackingProbe::MapsLeft),
                        InstanceMethod("exhaust", &PatternBackingProbe::Exhaust), InstanceMethod("close", &PatternBackingProbe::Close)});
  }
  // (no layer: the bookkeeping never reads it)
  explicit PatternBackingProbe(const Napi::CallbackInfo& info)
      : Napi::ObjectWrap<PatternBackingProbe>(info), pb_(std::make_unique<vmm::snapshot::PatternBacking>(nullptr)) {}

 private:
  static constexpr uint64_t kMaxPage = 1ull << 40;
  vmm::snapshot::PatternBacking& live(Napi::Env env) {
    if (!pb_) throw Napi::Error::New(env, "the probe is closed");
    return *pb_;
  }
  std::pair<uint64_t, uint64_t> Range(const Napi::CallbackInfo& info) {
    return {ToUint(info.Env(), info[0], "first", kMaxPage), ToUint(info.Env(), info[1], "count", 1 << 20)};
  }
  Napi::Value Add(const Napi::CallbackInfo& info) {
    auto [first, count] = Range(info);
    live(info.Env()).Add(first, count);
    return info.Env().Undefined();
  }
  Napi::Value Remove(const Napi::CallbackInfo& info) {
    auto [first, count] = Range(info);
    live(info.Env()).Remove(first, count);
    return info.Env().Undefined();
  }
  Napi::Value Has(const Napi::CallbackInfo& info) {
    return Napi::Boolean::New(info.Env(), live(info.Env()).Has(ToUint(info.Env(), info[0], "page", kMaxPage)));
  }
  Napi::Value Pages(const Napi::CallbackInfo& info) {
    const std::vector<uint64_t> pages = live(info.Env()).Pages();
    Napi::Array out = Napi::Array::New(info.Env(), pages.size());
    for (size_t i = 0; i < pages.size(); i++) out.Set(uint32_t(i), Napi::Number::New(info.Env(), double(pages[i])));
    return out;
  }
  Napi::Value Maps(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), double(live(info.Env()).maps())); }
  Napi::Value MapsLeft(const Napi::CallbackInfo& info) { return Napi::Number::New(info.Env(), double(live(info.Env()).MapsLeft())); }
  Napi::Value Exhaust(const Napi::CallbackInfo& info) {
    live(info.Env()).Exhaust();
    return info.Env().Undefined();
  }
  Napi::Value Close(const Napi::CallbackInfo& info) {
    pb_.reset();
    return info.Env().Undefined();
  }

  std::unique_ptr<vmm::snapshot::PatternBacking> pb_;
};

}  // namespace

void InitVmmTesting(Napi::Env env, Napi::Object exports) {
  Napi::Object t = Napi::Object::New(env);
  t.Set("VirtioTestDevice", VirtioTestDevice::Define(env));
  t.Set("GuestRamProbe", GuestRamProbe::Define(env));
  t.Set("PatternBackingProbe", PatternBackingProbe::Define(env));
  // packRoundTrip(pages, bases, ramPages?): pages i of `pages` packed against
  // pages i of `bases` (vmm/snapshot/packed_pages.h), then written back over
  // a copy of `bases` as into RAM of ramPages pages (default: all of them).
  t.Set("packRoundTrip", Napi::Function::New(env, [](const Napi::CallbackInfo& info) -> Napi::Value {
          Napi::Env env = info.Env();
          if (!info[0].IsBuffer() || !info[1].IsBuffer()) throw Napi::TypeError::New(env, "packRoundTrip(pages, bases, ramPages?)");
          auto pages = info[0].As<Napi::Buffer<uint8_t>>(), bases = info[1].As<Napi::Buffer<uint8_t>>();
          if (pages.Length() != bases.Length() || pages.Length() % 4096 != 0)
            throw Napi::RangeError::New(env, "pages and bases: the same whole number of 4096-byte pages");
          const uint64_t n = pages.Length() / 4096;
          const uint64_t ram_pages = info[2].IsNumber() ? ToUint(env, info[2], "ramPages", n) : n;
          vmm::snapshot::PackedPages store;
          Napi::Array added = Napi::Array::New(env, n);
          for (uint64_t i = 0; i < n; i++)
            added.Set(uint32_t(i), Napi::Boolean::New(env, store.Add(i, pages.Data() + i * 4096, bases.Data() + i * 4096)));
          const uint64_t encoded = store.encoded_bytes();
          store.Seal();
          Napi::Buffer<uint8_t> out = Napi::Buffer<uint8_t>::Copy(env, bases.Data(), bases.Length());
          const bool applied = store.Apply(out.Data(), ram_pages);
          Napi::Object o = Napi::Object::New(env);
          o.Set("added", added);
          o.Set("packedPages", Napi::Number::New(env, double(store.pages())));
          o.Set("encodedBytes", Napi::Number::New(env, double(encoded)));
          o.Set("hostBytes", Napi::Number::New(env, double(store.host_bytes())));
          o.Set("applied", Napi::Boolean::New(env, applied));
          o.Set("restored", out);
          return o;
        }));
  t.Set("squeezeZeros", Napi::Function::New(env, [](const Napi::CallbackInfo& info) -> Napi::Value {
          if (!info[0].IsBuffer()) throw Napi::TypeError::New(info.Env(), "squeezeZeros(bytes: Buffer)");
          auto in = info[0].As<Napi::Buffer<uint8_t>>();
          const std::vector<uint8_t> out = vmm::snapshot::SqueezeZeros(std::vector<uint8_t>(in.Data(), in.Data() + in.Length()));
          return Napi::Buffer<uint8_t>::Copy(info.Env(), out.data(), out.size());
        }));
  t.Set("expandZeros", Napi::Function::New(env, [](const Napi::CallbackInfo& info) -> Napi::Value {
          if (!info[0].IsBuffer()) throw Napi::TypeError::New(info.Env(), "expandZeros(bytes: Buffer, maxBytes)");
          auto in = info[0].As<Napi::Buffer<uint8_t>>();
          const uint64_t max = ToUint(info.Env(), info[1], "maxBytes", 1u << 30);
          try {
            const std::vector<uint8_t> out = vmm::snapshot::ExpandZeros(std::vector<uint8_t>(in.Data(), in.Data() + in.Length()), max);
            return Napi::Buffer<uint8_t>::Copy(info.Env(), out.data(), out.size());
          } catch (const vmm::snapshot::CorruptError& e) {
            throw Napi::Error::New(info.Env(), e.what());
          }
        }));
  t.Set("patternMapsInProcess", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
          return Napi::Number::New(info.Env(), double(vmm::snapshot::PatternMapsInProcess()));
        }));
  exports.Set("vmmTesting", t);
}

}  // namespace forkling
