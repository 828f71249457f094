#include "vmm/park_watch.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "vmm/vmm_thread.h"

namespace forkling::vmm::park_watch {
namespace {

struct Entry {
  int fd;
  std::function<void(uint64_t)> wake;
};

// Made at the first Watch and never freed: its thread lives as long as the process.
struct Watcher {
  std::mutex mu;
  int epfd = -1;
  uint64_t next_token = 1;
  std::unordered_map<uint64_t, Entry> entries;
  VmmThread thread;

  void Run() {
    pthread_setname_np(pthread_self(), "park-watch");
    epoll_event events[32];
    for (;;) {
      int n = epoll_wait(epfd, events, 32, -1);
      if (n < 0) continue;  // (EINTR; nothing else can fail on a valid epoll fd)
      for (int i = 0; i < n; i++) {
        const uint64_t token = events[i].data.u64;
        std::function<void(uint64_t)> wake;
        {
          std::lock_guard<std::mutex> l(mu);
          auto it = entries.find(token);
          if (it == entries.end()) continue;  // (forgotten after the event was read)
          epoll_ctl(epfd, EPOLL_CTL_DEL, it->second.fd, nullptr);
          wake = std::move(it->second.wake);
          entries.erase(it);
        }
        try {
          wake(token);
        } catch (...) {  // (out of memory in a device's restart: that device's own failure)
        }
      }
    }
  }
};

std::mutex start_mu;
Watcher* watcher = nullptr;

// The watch if one was made (Forget and Watched make none).
Watcher* Existing() {
  std::lock_guard<std::mutex> l(start_mu);
  return watcher;
}

Watcher* Get() {
  std::lock_guard<std::mutex> l(start_mu);
  if (watcher) return watcher;
  auto* w = new Watcher();
  w->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (w->epfd < 0) {
    delete w;
    return nullptr;
  }
  try {
    w->thread = VmmThread([w] { w->Run(); });
  } catch (const std::system_error& e) {
    close(w->epfd);
    delete w;
    errno = e.code().value();
    return nullptr;
  }
  watcher = w;
  return w;
}

}  // namespace

uint64_t Watch(int fd, std::function<void(uint64_t token)> wake) {
  Watcher* w = Get();
  if (!w) return 0;
  std::lock_guard<std::mutex> l(w->mu);
  const uint64_t token = w->next_token++;
  auto it = w->entries.emplace(token, Entry{fd, std::move(wake)}).first;  // (first: it may throw)
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = token;
  if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
    const int e = errno;
    w->entries.erase(it);
    errno = e;
    return 0;
  }
  return token;
}

void Forget(uint64_t token, int fd) {
  Watcher* w = Existing();
  if (!w || token == 0) return;
  std::lock_guard<std::mutex> l(w->mu);
  auto it = w->entries.find(token);
  if (it == w->entries.end()) return;
  epoll_ctl(w->epfd, EPOLL_CTL_DEL, fd, nullptr);
  w->entries.erase(it);
}

uint64_t Watched() {
  Watcher* w = Existing();
  if (!w) return 0;
  std::lock_guard<std::mutex> l(w->mu);
  return w->entries.size();
}

}  // namespace forkling::vmm::park_watch
