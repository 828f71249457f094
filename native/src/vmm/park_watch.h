// One thread of the whole process that watches the event loops of devices
// whose own thread has ended while their VM is shelved (virtio_vsock.h Park).
// Each such loop leaves its epoll fd here (an epoll fd is itself pollable:
// it reads ready when one of its fds is), and the watch calls the device back
// once, when that happens. A shelved child then runs no thread at all: each
// loop thread held a kernel stack and task structures (~30 KiB of the
// kernel's), more than the rest of what the child keeps.
#pragma once

#include <cstdint>
#include <functional>

namespace forkling::vmm::park_watch {

// Watches `fd` until it reads ready, then calls `wake(token)` once, on the
// watch's thread, with no lock of the watch's held (wake may call Forget).
// Returns the token (never 0), or 0 when the fd could not be watched (errno
// set); the caller then keeps its own thread. Throws std::bad_alloc only.
// Any thread.
uint64_t Watch(int fd, std::function<void(uint64_t token)> wake);

// Stops watching (if still watched): `wake` is not called for this token
// after Forget returns, unless it had already been taken to be called; the
// callee tells an old token from its current one. Call it before `fd` is
// closed (the watch forgets an fd by its number). Any thread, the watch's too.
void Forget(uint64_t token, int fd);

// Fds watched now (for tests and stats).
uint64_t Watched();

}  // namespace forkling::vmm::park_watch
