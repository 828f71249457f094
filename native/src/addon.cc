// The forkling native addon. Each part registers its functions on `exports`.
#include <napi.h>

namespace forkling {
// Raw syscall layer (syscalls.cc): /dev/kvm, KVM ioctls, mmap family, memfd, eventfd.
void InitSyscalls(Napi::Env env, Napi::Object exports);
// Test-only: virtio device models over an ArrayBuffer as guest RAM (vmm_testing.cc).
void InitVmmTesting(Napi::Env env, Napi::Object exports);
// Process engine launcher (sandbox/launch.cc): namespaces, root, seccomp, exec.
void InitSandbox(Napi::Env env, Napi::Object exports);
// In-process VMM (vmm_binding.cc, vmm/): Vm objects and the pure loader/device models.
void InitVmm(Napi::Env env, Napi::Object exports);
// Snapshot file formats (snapshot_binding.cc, vmm/snapshot/): tested without KVM.
void InitSnapshot(Napi::Env env, Napi::Object exports);
}  // namespace forkling

static Napi::Object Init(Napi::Env env, Napi::Object exports) {
  forkling::InitSyscalls(env, exports);
  forkling::InitVmmTesting(env, exports);
  forkling::InitSandbox(env, exports);
  forkling::InitVmm(env, exports);
  forkling::InitSnapshot(env, exports);
  return exports;
}

NODE_API_MODULE(forkling, Init)
