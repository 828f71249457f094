// The VMM's long-lived threads (vCPUs, device loops): std::thread with a
// small stack of its own. With glibc's default 8 MiB stack, a kernel whose
// transparent huge pages are "always" may back a thread's first stack touch
// with a whole 2 MiB page (every thread, where the kernel aligns large
// anonymous mappings to 2 MiB): more than an idle child's guest memory, per
// thread. A stack under 2 MiB cannot hold a huge page.
#pragma once

#include <pthread.h>

#include <cerrno>
#include <exception>
#include <functional>
#include <memory>
#include <system_error>
#include <utility>

namespace forkling::vmm {

class VmmThread {
 public:
  // Enough for the exit handlers, the device models and an exception's unwind.
  static constexpr size_t kStackBytes = 512 * 1024;

  VmmThread() = default;
  // Starts fn on a new thread; throws std::system_error if none can be made.
  explicit VmmThread(std::function<void()> fn) {
    auto body = std::make_unique<std::function<void()>>(std::move(fn));
    pthread_attr_t attr;
    if (int e = pthread_attr_init(&attr)) throw std::system_error(e, std::generic_category(), "pthread_attr_init");
    int e = pthread_attr_setstacksize(&attr, kStackBytes);
    if (!e) e = pthread_create(&tid_, &attr, &Run, body.get());
    pthread_attr_destroy(&attr);
    if (e) throw std::system_error(e, std::generic_category(), "pthread_create");
    body.release();  // Run owns it now
    joinable_ = true;
  }
  VmmThread(const VmmThread&) = delete;
  VmmThread& operator=(const VmmThread&) = delete;
  VmmThread(VmmThread&& o) noexcept : tid_(o.tid_), joinable_(std::exchange(o.joinable_, false)) {}
  VmmThread& operator=(VmmThread&& o) noexcept {
    if (this != &o) {
      if (joinable_) std::terminate();  // as std::thread: a running thread is never dropped
      tid_ = o.tid_;
      joinable_ = std::exchange(o.joinable_, false);
    }
    return *this;
  }
  ~VmmThread() {
    if (joinable_) std::terminate();
  }

  bool joinable() const { return joinable_; }
  void join() {
    if (!joinable_) throw std::system_error(EINVAL, std::generic_category(), "join: no thread");
    if (int e = pthread_join(tid_, nullptr)) throw std::system_error(e, std::generic_category(), "pthread_join");
    joinable_ = false;
  }
  pthread_t native_handle() const { return tid_; }

 private:
  // An exception that escapes the body ends the process, as with std::thread.
  static void* Run(void* p) noexcept {
    std::unique_ptr<std::function<void()>> body(static_cast<std::function<void()>*>(p));
    (*body)();
    return nullptr;
  }

  pthread_t tid_{};
  bool joinable_ = false;
};

}  // namespace forkling::vmm
