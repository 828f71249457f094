// Node binding of the snapshot file formats (native/src/vmm/snapshot/), so
// they are tested without KVM: state-file sections, the sparse memory file
// and its verification, pagemap accounting, and diff layers (write, open,
// collapse, map over a base file).
#include <napi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <system_error>

#include "errno_error.h"
#include "js_uint.h"
#include "mapping.h"
#include "snapshot_js.h"
#include "vmm/snapshot/checksum.h"
#include "vmm/snapshot/diff_layer.h"
#include "vmm/snapshot/memory_file.h"
#include "vmm/snapshot/pagemap.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/snapshot/packed_pages.h"
#include "vmm/snapshot/reclaim.h"
#include "vmm/snapshot/state_file.h"
#include "vmm/snapshot/vm_snapshot.h"

namespace forkling {
namespace {

namespace ss = vmm::snapshot;

// Closes an fd at the end of its scope.
struct FdCloser {
  int fd;
  explicit FdCloser(int f) : fd(f) {}
  ~FdCloser() { close(fd); }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
};

// Runs fn, turning C++ exceptions into JS errors (CorruptError keeps
// code 'ECORRUPT' so callers can tell a bad file from a failed syscall).
template <class Fn>
Napi::Value Guard(Napi::Env env, Fn fn) {
  try {
    return fn();
  } catch (const ss::CorruptError& e) {
    Napi::Error err = Napi::Error::New(env, e.what());
    err.Set("code", Napi::String::New(env, "ECORRUPT"));
    err.ThrowAsJavaScriptException();
  } catch (const std::system_error& e) {
    Napi::Error err = ErrnoError(env, e.what(), e.code().value());
    err.ThrowAsJavaScriptException();
  } catch (const std::exception& e) {
    Napi::Error::New(env, e.what()).ThrowAsJavaScriptException();
  }
  return env.Undefined();
}

// Bytes of a Buffer/TypedArray/ArrayBuffer or a Mapping (address, length).
bool Bytes(Napi::Value v, uint8_t** p, size_t* n) {
  MappingView m;
  if (GetMapping(v, &m)) {
    *p = static_cast<uint8_t*>(m.addr);
    *n = m.length;
    return true;
  }
  if (v.IsArrayBuffer()) {
    auto ab = v.As<Napi::ArrayBuffer>();
    *p = static_cast<uint8_t*>(ab.Data());
    *n = ab.ByteLength();
    return true;
  }
  if (v.IsTypedArray()) {
    auto ta = v.As<Napi::TypedArray>();
    *p = static_cast<uint8_t*>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
    *n = ta.ByteLength();
    return true;
  }
  return false;
}

std::vector<uint64_t> PageList(Napi::Env env, Napi::Value v) {
  if (!v.IsArray()) throw std::invalid_argument("pages must be an array of page numbers");
  auto a = v.As<Napi::Array>();
  std::vector<uint64_t> out(a.Length());
  for (uint32_t i = 0; i < a.Length(); i++) {
    Napi::Value x = a.Get(i);
    if (!x.IsNumber() || x.As<Napi::Number>().DoubleValue() < 0) throw std::invalid_argument("bad page number");
    out[i] = uint64_t(x.As<Napi::Number>().Int64Value());
  }
  return out;
}

Napi::Array ToArray(Napi::Env env, const std::vector<uint64_t>& v) {
  Napi::Array a = Napi::Array::New(env, v.size());
  for (size_t i = 0; i < v.size(); i++) a.Set(uint32_t(i), Napi::Number::New(env, double(v[i])));
  return a;
}

Napi::Object InfoToJs(Napi::Env env, const ss::MemoryFileInfo& i) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("size", Napi::Number::New(env, double(i.size)));
  o.Set("dataPages", Napi::Number::New(env, double(i.data_pages)));
  o.Set("checksum", Napi::Number::New(env, i.checksum));
  return o;
}

ss::MemoryFileInfo InfoFromJs(Napi::Value v) {
  if (!v.IsObject()) throw std::invalid_argument("info must be an object");
  auto o = v.As<Napi::Object>();
  ss::MemoryFileInfo i;
  i.size = uint64_t(o.Get("size").As<Napi::Number>().Int64Value());
  i.data_pages = uint64_t(o.Get("dataPages").As<Napi::Number>().Int64Value());
  i.checksum = o.Get("checksum").As<Napi::Number>().Uint32Value();
  return i;
}

using LayerRef = std::shared_ptr<ss::DiffLayer>;

Napi::Value WrapLayer(Napi::Env env, LayerRef layer) {
  auto* holder = new LayerRef(std::move(layer));
  Napi::Object o = Napi::Object::New(env);
  o.Set("handle", Napi::External<LayerRef>::New(env, holder, [](Napi::Env, LayerRef* h) { delete h; }));
  o.Set("pageCount", Napi::Number::New(env, double((*holder)->page_count())));
  o.Set("runCount", Napi::Number::New(env, double((*holder)->runs().size())));
  o.Set("ramSize", Napi::Number::New(env, double((*holder)->ram_size())));
  return o;
}

// The layer inside a value made by WrapLayer; throws `usage` for anything
// else (a snapshot's handle is an External too: told apart by its fields).
LayerRef LayerOf(Napi::Value v, const char* usage) {
  if (!v.IsObject()) throw std::invalid_argument(usage);
  Napi::Object o = v.As<Napi::Object>();
  if (!o.Get("handle").IsExternal() || !o.Get("pageCount").IsNumber() || !o.Get("runCount").IsNumber() || o.Has("what"))
    throw std::invalid_argument(usage);
  return *o.Get("handle").As<Napi::External<LayerRef>>().Data();
}

std::vector<LayerRef> Chain(Napi::Value v) {
  if (!v.IsArray()) throw std::invalid_argument("chain must be an array of diff layers");
  auto a = v.As<Napi::Array>();
  std::vector<LayerRef> out;
  for (uint32_t i = 0; i < a.Length(); i++) out.push_back(LayerOf(a.Get(i), "chain must be an array of diff layers"));
  return out;
}

int FdArg(const Napi::Value& v) {
  if (!v.IsNumber()) throw std::invalid_argument("fd must be a number");
  return v.As<Napi::Number>().Int32Value();
}

using SpecRef = std::shared_ptr<const vmm::RestoreSpec>;

Napi::Object WrapSpec(Napi::Env env, SpecRef spec) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("memoryMiB", Napi::Number::New(env, double(spec->memory_bytes >> 20)));
  o.Set("vcpus", Napi::Number::New(env, spec->vcpus));
  o.Set("depth", Napi::Number::New(env, double(spec->layers.size())));
  o.Set("what", Napi::String::New(env, spec->what));
  o.Set("handle", Napi::External<SpecRef>::New(env, new SpecRef(std::move(spec)), [](Napi::Env, SpecRef* p) { delete p; }));
  return o;
}

using PreparedRef = std::unique_ptr<PreparedVm>;

// Creates VMs from one snapshot on up to kPrepareThreads threads.
class PrepareWorker : public Napi::AsyncWorker {
 public:
  static constexpr size_t kPrepareThreads = 16;
  PrepareWorker(Napi::Env env, SpecRef spec, std::vector<vmm::VmConfig> cfgs)
      : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), spec_(std::move(spec)),
        cfgs_(std::move(cfgs)), vms_(cfgs_.size()), errors_(cfgs_.size()) {}
  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < cfgs_.size();) {
        try {
          auto p = std::make_unique<PreparedVm>();
          p->events = std::make_shared<EventForwarder>();
          std::shared_ptr<EventForwarder> fwd = p->events;
          p->vm = std::make_unique<vmm::Vm>(cfgs_[i], [fwd](vmm::VmEvent&& e) { fwd->Post(std::move(e)); }, spec_);
          vms_[i] = std::move(p);
        } catch (const std::exception& e) {
          errors_[i] = e.what();
          if (errors_[i].empty()) errors_[i] = "VM creation failed";
        }
      }
    };
    std::vector<std::thread> threads;
    size_t n = std::min(kPrepareThreads, cfgs_.size());
    for (size_t t = 1; t < n; t++) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
  }
  void OnOK() override {
    Napi::Env env = Env();
    for (size_t i = 0; i < errors_.size(); i++) {
      if (!errors_[i].empty()) {
        vms_.clear();  // kills every VM made
        deferred_.Reject(Napi::Error::New(env, errors_[i]).Value());
        return;
      }
    }
    Napi::Array a = Napi::Array::New(env, vms_.size());
    for (size_t i = 0; i < vms_.size(); i++) {
      Napi::Object o = Napi::Object::New(env);
      o.Set("prepared", Napi::External<PreparedRef>::New(env, new PreparedRef(std::move(vms_[i])),
                                                         [](Napi::Env, PreparedRef* p) { delete p; }));
      a.Set(uint32_t(i), o);
    }
    deferred_.Resolve(a);
  }
  void OnError(const Napi::Error& e) override { deferred_.Reject(e.Value()); }

 private:
  Napi::Promise::Deferred deferred_;
  SpecRef spec_;
  std::vector<vmm::VmConfig> cfgs_;
  std::vector<PreparedRef> vms_;
  std::vector<std::string> errors_;
};

}  // namespace

std::unique_ptr<PreparedVm> TakePreparedVm(Napi::Value v) {
  if (v.IsObject()) {
    Napi::Value h = v.As<Napi::Object>().Get("prepared");
    if (h.IsExternal()) {
      PreparedRef* p = h.As<Napi::External<PreparedRef>>().Data();
      if (*p) return std::move(*p);
      throw Napi::TypeError::New(v.Env(), "this prepared VM was already taken");
    }
  }
  throw Napi::TypeError::New(v.Env(), "prepared must be a value made by snapshot.prepareVms()");
}

std::shared_ptr<const vmm::RestoreSpec> RestoreSpecOf(Napi::Value v) {
  if (v.IsObject()) {
    Napi::Value h = v.As<Napi::Object>().Get("handle");
    if (h.IsExternal()) {
      // Only specs are stored as handles on objects with a `what` string.
      if (v.As<Napi::Object>().Get("what").IsString()) return *h.As<Napi::External<SpecRef>>().Data();
    }
  }
  throw Napi::TypeError::New(v.Env(), "restore must be a snapshot made by loadTemplate() or branch()");
}

Napi::Value VmSaveTemplate(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    if (!info[0].IsString()) throw std::invalid_argument("saveTemplate(dir)");
    ss::TemplateWritten w = ss::WriteTemplate(vm, info[0].As<Napi::String>());
    Napi::Object o = Napi::Object::New(info.Env());
    o.Set("memory", InfoToJs(info.Env(), w.memory));
    o.Set("stateBytes", Napi::Number::New(info.Env(), double(w.state_bytes)));
    o.Set("saveMs", Napi::Number::New(info.Env(), w.save_ms));
    o.Set("memoryMs", Napi::Number::New(info.Env(), w.memory_ms));
    return o;
  });
}

Napi::Value VmBranch(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    if (!info[0].IsString()) throw std::invalid_argument("branch(dir)");
    ss::BranchResult b = ss::Branch(vm, info[0].As<Napi::String>());
    Napi::Env env = info.Env();
    Napi::Object o = Napi::Object::New(env);
    o.Set("snapshot", WrapSpec(env, b.spec));
    o.Set("pauseUs", Napi::Number::New(env, double(b.pause_ns) / 1000.0));
    Napi::Object parts = Napi::Object::New(env);
    parts.Set("stopUs", Napi::Number::New(env, double(b.stop_ns) / 1000.0));
    parts.Set("saveUs", Napi::Number::New(env, double(b.save_ns) / 1000.0));
    parts.Set("scanUs", Napi::Number::New(env, double(b.scan_ns) / 1000.0));
    parts.Set("copyUs", Napi::Number::New(env, double(b.copy_ns) / 1000.0));
    o.Set("pauseParts", parts);
    o.Set("precopyUs", Napi::Number::New(env, double(b.precopy_ns) / 1000.0));
    o.Set("precopyPages", Napi::Number::New(env, double(b.precopy_pages)));
    o.Set("recopiedPages", Napi::Number::New(env, double(b.recopied_pages)));
    o.Set("privatePages", Napi::Number::New(env, double(b.private_pages)));
    o.Set("diffPages", Napi::Number::New(env, double(b.diff_pages)));
    o.Set("runs", Napi::Number::New(env, double(b.runs)));
    o.Set("depth", Napi::Number::New(env, double(b.depth)));
    o.Set("collapsed", Napi::Boolean::New(env, b.collapsed));
    return o;
  });
}

Napi::Value VmMemoryUsage(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    ss::MemoryUsage u = ss::MeasureGuestMemory(vm);
    Napi::Env env = info.Env();
    Napi::Object o = Napi::Object::New(env);
    o.Set("guestPrivateBytes", Napi::Number::New(env, double(u.guest_private_bytes)));
    o.Set("guestSharedBytes", Napi::Number::New(env, double(u.guest_shared_bytes)));
    o.Set("guestMemfdBytes", Napi::Number::New(env, double(u.guest_memfd_bytes)));
    o.Set("guestPatternBytes", Napi::Number::New(env, double(u.guest_pattern_bytes)));
    o.Set("guestTableBytes", Napi::Number::New(env, double(u.guest_table_bytes)));
    // memoryUsage({frames: true}): also the guest frame numbers of the private pages.
    if (info.Length() > 0 && info[0].IsObject() && info[0].As<Napi::Object>().Get("frames").ToBoolean()) {
      std::vector<uint64_t> f = ss::PrivateGuestFrames(vm);
      Napi::Float64Array a = Napi::Float64Array::New(env, f.size());
      for (size_t i = 0; i < f.size(); i++) a[i] = double(f[i]);
      o.Set("privateFrames", a);
    }
    return o;
  });
}

Napi::Value VmReclaim(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    uint64_t from = 0, max = ~uint64_t(0);
    if (info.Length() > 0 && info[0].IsObject()) {
      Napi::Object opts = info[0].As<Napi::Object>();
      auto whole = [&](const char* key, uint64_t* out) {
        Napi::Value v = opts.Get(key);
        if (v.IsUndefined()) return;
        if (!v.IsNumber()) throw std::invalid_argument(std::string("reclaim: ") + key + " must be a number");
        *out = ToU64(info.Env(), v, std::string("reclaim: ") + key);
      };
      whole("fromPage", &from);
      whole("maxPages", &max);
    }
    ss::ReclaimResult r = ss::Reclaim(vm, from, max);
    Napi::Env env = info.Env();
    Napi::Object o = Napi::Object::New(env);
    o.Set("nextPage", r.done ? env.Null() : Napi::Number::New(env, double(r.next_page)));
    o.Set("privatePages", Napi::Number::New(env, double(r.private_pages)));
    o.Set("droppedPages", Napi::Number::New(env, double(r.dropped_pages)));
    o.Set("patternPages", Napi::Number::New(env, double(r.pattern_pages)));
    o.Set("pauseUs", Napi::Number::New(env, double(r.pause_ns) / 1000.0));
    o.Set("longestPauseUs", Napi::Number::New(env, double(r.longest_pause_ns) / 1000.0));
    o.Set("totalUs", Napi::Number::New(env, double(r.total_ns) / 1000.0));
    return o;
  });
}

Napi::Value VmPack(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    Napi::Env env0 = info.Env();
    bool shelve = true;
    if (info.Length() > 0 && info[0].IsObject()) {
      Napi::Value v = info[0].As<Napi::Object>().Get("shelve");
      if (!v.IsUndefined()) {
        if (!v.IsBoolean()) throw Napi::TypeError::New(env0, "pack: shelve must be a boolean");
        shelve = v.As<Napi::Boolean>().Value();
      }
    }
    ss::PackResult r = vm.Pack(shelve);
    Napi::Env env = info.Env();
    Napi::Object o = Napi::Object::New(env);
    o.Set("packed", Napi::Boolean::New(env, r.packed));
    o.Set("privatePages", Napi::Number::New(env, double(r.private_pages)));
    o.Set("packedPages", Napi::Number::New(env, double(r.packed_pages)));
    o.Set("keptPages", Napi::Number::New(env, double(r.kept_pages)));
    o.Set("hostBytes", Napi::Number::New(env, double(r.host_bytes)));
    o.Set("ramTablesDropped", Napi::Boolean::New(env, r.ram_tables_dropped));
    o.Set("shelved", Napi::Boolean::New(env, r.shelved));
    o.Set("totalUs", Napi::Number::New(env, double(r.total_ns) / 1000.0));
    return o;
  });
}

Napi::Value VmCapturePattern(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    const char* usage = "capturePattern(dir, others?: Vm[])";
    if (!info[0].IsString()) throw std::invalid_argument(usage);
    std::vector<vmm::Vm*> others;
    if (info.Length() > 1 && !info[1].IsUndefined()) {
      if (!info[1].IsArray()) throw std::invalid_argument(usage);
      Napi::Array a = info[1].As<Napi::Array>();
      for (uint32_t i = 0; i < a.Length(); i++) others.push_back(&VmOf(a.Get(i)));
    }
    return WrapLayer(info.Env(), ss::CapturePattern(vm, others, info[0].As<Napi::String>()));
  });
}

Napi::Value VmSetPattern(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    vm.SetPattern(LayerOf(info[0], "setPattern(layer): a layer from capturePattern"));
    return info.Env().Undefined();
  });
}

namespace {
uint8_t* GuestSpan(const Napi::CallbackInfo& info, vmm::Vm& vm, uint64_t len) {
  if (!info[0].IsNumber()) throw std::invalid_argument("the guest physical address must be a number");
  uint8_t* p = vm.ram().memory().Ptr(ToU64(info.Env(), info[0], "the guest physical address"), len);
  if (!p || len == 0) throw std::range_error("the range is not inside guest RAM");
  return p;
}
}  // namespace

Napi::Value VmGuestBytes(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    if (!info[1].IsNumber()) throw std::invalid_argument("guestBytes(gpa, length)");
    const uint64_t n = ToU64(info.Env(), info[1], "length");
    if (n < 1 || n > (64u << 20)) throw std::invalid_argument("length must be 1..64 MiB");
    vm.Unpack();  // (the guest's bytes, not a packed page's backing)
    uint8_t* p = GuestSpan(info, vm, n);
    return Napi::Buffer<uint8_t>::Copy(info.Env(), p, size_t(n));
  });
}

Napi::Value VmWriteGuestBytes(const Napi::CallbackInfo& info, vmm::Vm& vm) {
  return Guard(info.Env(), [&]() -> Napi::Value {
    uint8_t* src;
    size_t n;
    if (!Bytes(info[1], &src, &n)) throw std::invalid_argument("writeGuestBytes(gpa, bytes)");
    vm.Unpack();
    uint8_t* p = GuestSpan(info, vm, n);
    std::memcpy(p, src, n);
    return info.Env().Undefined();
  });
}

void InitSnapshot(Napi::Env env, Napi::Object exports) {
  Napi::Object s = Napi::Object::New(env);
  s.Set("crc32c", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[0], &p, &n)) throw std::invalid_argument("crc32c(bytes, seed?)");
      uint32_t seed = info[1].IsNumber() ? info[1].As<Napi::Number>().Uint32Value() : 0;
      return Napi::Number::New(info.Env(), ss::Crc32c(p, n, seed));
    });
  }));
  s.Set("encodeStateFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      if (!info[0].IsArray()) throw std::invalid_argument("encodeStateFile(sections)");
      auto a = info[0].As<Napi::Array>();
      std::vector<ss::Section> secs;
      for (uint32_t i = 0; i < a.Length(); i++) {
        auto o = a.Get(i).As<Napi::Object>();
        ss::Section sec;
        sec.tag = o.Get("tag").As<Napi::Number>().Uint32Value();
        sec.index = o.Get("index").As<Napi::Number>().Uint32Value();
        uint8_t* p;
        size_t n;
        if (!Bytes(o.Get("data"), &p, &n)) throw std::invalid_argument("section data must be bytes");
        sec.data.assign(p, p + n);
        secs.push_back(std::move(sec));
      }
      std::vector<uint8_t> b = ss::EncodeStateFile(secs);
      return Napi::Buffer<uint8_t>::Copy(info.Env(), b.data(), b.size());
    });
  }));
  s.Set("decodeStateFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[0], &p, &n) || !info[1].IsString()) throw std::invalid_argument("decodeStateFile(bytes, what)");
      std::vector<ss::Section> secs = ss::DecodeStateFile(p, n, info[1].As<Napi::String>());
      Napi::Array a = Napi::Array::New(info.Env(), secs.size());
      for (size_t i = 0; i < secs.size(); i++) {
        Napi::Object o = Napi::Object::New(info.Env());
        o.Set("tag", Napi::Number::New(info.Env(), secs[i].tag));
        o.Set("index", Napi::Number::New(info.Env(), secs[i].index));
        o.Set("data", Napi::Buffer<uint8_t>::Copy(info.Env(), secs[i].data.data(), secs[i].data.size()));
        a.Set(uint32_t(i), o);
      }
      return a;
    });
  }));
  s.Set("writeMemoryFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[0], &p, &n) || !info[1].IsString())
        throw std::invalid_argument("writeMemoryFile(bytes, path, srcFd?)");
      int src = info[2].IsNumber() ? info[2].As<Napi::Number>().Int32Value() : -1;
      return InfoToJs(info.Env(), ss::WriteMemoryFile(p, n, src, info[1].As<Napi::String>()));
    });
  }));
  s.Set("scanMemoryFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      const std::string path = info[0].As<Napi::String>(), what = info[1].As<Napi::String>();
      FdCloser fd(ss::OpenStoreFile(path, what, "memory file"));
      return InfoToJs(info.Env(), ss::ScanMemoryFile(fd.fd, path, what));
    });
  }));
  s.Set("verifyMemoryFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      const std::string path = info[0].As<Napi::String>(), what = info[2].As<Napi::String>();
      FdCloser fd(ss::OpenStoreFile(path, what, "memory file"));
      ss::VerifyMemoryFile(fd.fd, path, InfoFromJs(info[1]), what);
      return info.Env().Undefined();
    });
  }));
  s.Set("clearVerifyCache", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    ss::ClearVerifyCache();
    return info.Env().Undefined();
  }));
  s.Set("pageCounts", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[0], &p, &n)) throw std::invalid_argument("pageCounts(mapping)");
      ss::PageCounts c = ss::CountPages(p, n);
      Napi::Object o = Napi::Object::New(info.Env());
      o.Set("private", Napi::Number::New(info.Env(), double(c.private_pages)));
      o.Set("shared", Napi::Number::New(info.Env(), double(c.shared_pages)));
      o.Set("tableSpans", Napi::Number::New(info.Env(), double(c.table_spans)));
      return o;
    });
  }));
  s.Set("privatePages", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[0], &p, &n)) throw std::invalid_argument("privatePages(mapping)");
      return ToArray(info.Env(), ss::PrivatePages(p, n));
    });
  }));
  s.Set("fillGaps", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      return ToArray(info.Env(), ss::FillGaps(PageList(info.Env(), info[0]), info[1].As<Napi::Number>().Uint32Value()));
    });
  }));
  s.Set("writeDiff", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint8_t* p;
      size_t n;
      if (!Bytes(info[1], &p, &n)) throw std::invalid_argument("writeDiff(fd, memory, pages, dataChecksum?)");
      std::vector<uint64_t> pages = PageList(info.Env(), info[2]);
      for (uint64_t pg : pages)
        if (pg >= n / ss::kPageSize) throw std::invalid_argument("page outside the memory");
      ss::WriteDiff(FdArg(info[0]), p, n, pages, !info[3].IsBoolean() || info[3].As<Napi::Boolean>().Value());
      return info.Env().Undefined();
    });
  }));
  s.Set("openDiff", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      // The layer takes its own descriptor; the caller keeps (and closes) theirs.
      int fd = dup(FdArg(info[0]));
      if (fd < 0) throw std::system_error(errno, std::generic_category(), "dup");
      return WrapLayer(info.Env(), ss::DiffLayer::Open(fd, info[1].As<Napi::String>()));
    });
  }));
  s.Set("diffPages", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      Napi::Array one = Napi::Array::New(info.Env(), 1);
      one.Set(0u, info[0]);
      std::vector<LayerRef> c = Chain(one);
      return ToArray(info.Env(), c[0]->Pages());
    });
  }));
  s.Set("collapseDiffs", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      ss::CollapseDiffs(Chain(info[0]), FdArg(info[1]));
      return info.Env().Undefined();
    });
  }));
  s.Set("mapLayered", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      uint64_t size = uint64_t(info[1].As<Napi::Number>().Int64Value());
      uint8_t* p = ss::MapLayered(FdArg(info[0]), size, Chain(info[2]));
      return Napi::ArrayBuffer::New(info.Env(), p, size, [](Napi::Env, void* d, size_t* sz) {
        munmap(d, *sz);
        delete sz;
      }, new size_t(size));
    });
  }));
  s.Set("createTempDiffFile", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      return Napi::Number::New(info.Env(), ss::CreateTempDiffFile(info[0].As<Napi::String>()));
    });
  }));
  s.Set("loadTemplate", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    return Guard(info.Env(), [&]() -> Napi::Value {
      if (!info[0].IsString() || !info[1].IsString()) throw std::invalid_argument("loadTemplate(dir, what)");
      return WrapSpec(info.Env(), ss::LoadTemplate(info[0].As<Napi::String>(), info[1].As<Napi::String>()));
    });
  }));
  // prepareVms(snapshot, [{vsockPath, vsockCid?, rng?}]) -> Promise<[{prepared}]>:
  // the VMs are created and restored on worker threads, not started.
  s.Set("prepareVms", Napi::Function::New(env, [](const Napi::CallbackInfo& info) -> Napi::Value {
    Napi::Env env = info.Env();
    SpecRef spec = RestoreSpecOf(info[0]);
    if (!info[1].IsArray()) throw Napi::TypeError::New(env, "prepareVms(snapshot, configs)");
    auto a = info[1].As<Napi::Array>();
    if (a.Length() == 0 || a.Length() > 1024) throw Napi::RangeError::New(env, "prepareVms: 1 to 1024 VMs");
    std::vector<vmm::VmConfig> cfgs;
    for (uint32_t i = 0; i < a.Length(); i++) {
      if (!a.Get(i).IsObject()) throw Napi::TypeError::New(env, "prepareVms: configs must be objects");
      Napi::Object o = a.Get(i).As<Napi::Object>();
      vmm::VmConfig c;
      c.memory_bytes = spec->memory_bytes;
      c.vcpus = spec->vcpus;
      if (!o.Get("vsockPath").IsString()) throw Napi::TypeError::New(env, "prepareVms: vsockPath must be a string");
      c.vsock_path = o.Get("vsockPath").As<Napi::String>();
      if (o.Get("vsockCid").IsNumber()) c.vsock_cid = uint64_t(o.Get("vsockCid").As<Napi::Number>().Int64Value());
      if (!o.Get("rng").IsUndefined()) c.rng = o.Get("rng").ToBoolean().Value();
      cfgs.push_back(std::move(c));
    }
    auto* w = new PrepareWorker(env, spec, std::move(cfgs));
    Napi::Promise p = w->Promise();
    w->Queue();
    return p;
  }));
  // releasePrepared(prepared): a prepared VM nobody will start goes now (its KVM VM, guest
  // mapping and vsock socket), not when the garbage collector gets to its wrapper; a
  // prepared VM already taken, or released, is left alone.
  s.Set("releasePrepared", Napi::Function::New(env, [](const Napi::CallbackInfo& info) {
    Napi::Value v = info[0];
    if (v.IsObject()) {
      Napi::Value h = v.As<Napi::Object>().Get("prepared");
      if (h.IsExternal()) h.As<Napi::External<PreparedRef>>().Data()->reset();
    }
    return info.Env().Undefined();
  }));
  exports.Set("snapshot", s);
}

}  // namespace forkling
