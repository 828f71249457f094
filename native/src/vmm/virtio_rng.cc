#include "vmm/virtio_rng.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

namespace forkling::vmm {

void VirtioRng::ReadConfig(uint32_t offset, uint8_t* data, uint32_t len) {
  // No config space.
  std::memset(data, 0, len);
}

void VirtioRng::Activate(const GuestMemory& mem, const std::vector<QueueConfig>& queues, uint64_t driver_features,
                         NotifyGuest notify_guest) {
  std::lock_guard<std::mutex> l(mu_);
  QueueConfig cfg = queues.empty() ? QueueConfig() : queues[0];
  std::string err = queue_.Init(mem, cfg, kQueueSize, (driver_features & kVirtioFIndirectDesc) != 0, "virtio-rng queue");
  notify_ = std::move(notify_guest);
  driver_features_ = driver_features;
  active_ = err.empty();
  if (!err.empty()) Fail(err);
}

void VirtioRng::QueueNotify(uint16_t queue) {
  std::lock_guard<std::mutex> l(mu_);
  if (!active_ || queue != 0 || failed()) return;
  bool pushed = false;
  uint8_t buf[4096];
  // At most one ring's worth per kick: a guest re-posting buffers from another vCPU while
  // this runs must not keep this vCPU thread here for ever (holding the VM's I/O lock, so
  // that pause and kill, on Node's thread, waited for ever). A guest kicks after each post.
  for (uint32_t n = 0; n < queue_.size(); n++) {
    std::string err;
    Virtqueue::PopResult r = queue_.Pop(&chain_, &err);
    if (r == Virtqueue::PopResult::kEmpty) break;
    if (r == Virtqueue::PopResult::kError) {
      active_ = false;
      Fail(err);
      break;
    }
    uint64_t want = chain_.writable_len < kMaxBytesPerRequest ? chain_.writable_len : kMaxBytesPerRequest;
    uint64_t done = 0;
    while (done < want) {
      size_t n = want - done < sizeof buf ? want - done : sizeof buf;
      ssize_t got = getrandom(buf, n, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        active_ = false;
        Fail(std::string("virtio-rng: getrandom failed: ") + std::strerror(errno));
        return;
      }
      chain_.Write(done, buf, static_cast<uint64_t>(got));
      done += static_cast<uint64_t>(got);
    }
    queue_.PushUsed(chain_.head, static_cast<uint32_t>(done));
    pushed = true;
  }
  if (pushed && notify_ && queue_.ShouldNotify()) notify_(0);
}

void VirtioRng::Reset() {
  std::lock_guard<std::mutex> l(mu_);
  active_ = false;
  driver_features_ = 0;
  queue_.Clear();
  notify_ = nullptr;
  ClearFailure();
}

VirtioRng::State VirtioRng::SaveState() const {
  std::lock_guard<std::mutex> l(mu_);
  return State{active_, driver_features_, queue_.state()};
}

void VirtioRng::RestoreState(const GuestMemory& mem, const State& state, NotifyGuest notify_guest) {
  std::lock_guard<std::mutex> l(mu_);
  ClearFailure();
  queue_.Clear();
  active_ = false;
  driver_features_ = state.driver_features;
  notify_ = std::move(notify_guest);
  if (!state.active) return;
  std::string err = queue_.Restore(mem, state.queue, kQueueSize, (state.driver_features & kVirtioFIndirectDesc) != 0,
                                   "virtio-rng queue");
  active_ = err.empty();
  if (!err.empty()) Fail(err);
}

}  // namespace forkling::vmm
