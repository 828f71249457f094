#include "vmm/ram_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace forkling::vmm::ram_guard {
namespace {

// The handler reads the table without locks (a signal handler may not take
// one): a slot's range is written only while it is unused (end == 0).
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};  // 0: unused
  std::atomic<uint32_t> lost{0};
};
// One per live VM; untouched slots cost no memory (bss).
constexpr size_t kSlots = 16384;
Slot g_slots[kSlots];
std::atomic<size_t> g_used{0};  // slots at or above this have never been used
std::mutex g_mu;                // Register / Unregister
struct sigaction g_previous;

void ResetToDefault() {
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // A fault (si_code > 0) has an address; a SIGBUS sent by kill() or tgkill() does not.
  const uintptr_t at = info->si_code > 0 ? reinterpret_cast<uintptr_t>(info->si_addr) : 0;
  const size_t used = at ? g_used.load(std::memory_order_acquire) : 0;
  for (size_t i = 0; i < used; i++) {
    Slot& s = g_slots[i];
    const uintptr_t end = s.end.load(std::memory_order_acquire);
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    if (end == 0 || at < begin || at >= end) continue;
    // Marked first: whoever reads zeros from here on can know why.
    s.lost.store(1, std::memory_order_seq_cst);
    // mmap is a plain system call, safe here. The whole range: the VM is lost
    // whatever it held, and one mapping cannot run out of VMAs fault by fault.
    void* p = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    errno = saved_errno;
    if (p != MAP_FAILED) return;
    break;  // cannot absorb it: as if unguarded
  }
  // Not ours: what was there before us. (sa_handler and sa_sigaction share storage.)
  const struct sigaction prev = g_previous;
  if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
    // The default action (the process ends, as without us): a fault meets it
    // again on return; a sent signal is sent again (pending until we return).
    ResetToDefault();
    if (info->si_code <= 0) raise(SIGBUS);
    errno = saved_errno;
    return;
  }
  if (prev.sa_flags & SA_RESETHAND) ResetToDefault();
  if (prev.sa_flags & SA_SIGINFO) prev.sa_sigaction(sig, info, context);
  else prev.sa_handler(sig);
  errno = saved_errno;
}

void Install() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = OnSigbus;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGBUS, nullptr, &g_previous);  // (read first: our handler may run as soon as it is in)
  sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace

int Register(uint8_t* host, uint64_t size) {
  if (!host || size == 0) return -1;
  std::lock_guard<std::mutex> l(g_mu);
  static bool installed = false;
  if (!installed) {
    Install();
    installed = true;
  }
  const size_t used = g_used.load(std::memory_order_relaxed);
  for (size_t i = 0; i < kSlots; i++) {
    Slot& s = g_slots[i];
    if (i < used && s.end.load(std::memory_order_relaxed) != 0) continue;
    s.lost.store(0, std::memory_order_relaxed);
    s.begin.store(reinterpret_cast<uintptr_t>(host), std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(host) + size, std::memory_order_release);
    if (i >= used) g_used.store(i + 1, std::memory_order_release);
    return int(i);
  }
  return -1;
}

void Unregister(int slot) {
  if (slot < 0 || size_t(slot) >= kSlots) return;
  std::lock_guard<std::mutex> l(g_mu);
  g_slots[slot].end.store(0, std::memory_order_release);
  g_slots[slot].begin.store(0, std::memory_order_relaxed);
  g_slots[slot].lost.store(0, std::memory_order_relaxed);
}

const std::atomic<uint32_t>* LostFlag(int slot) {
  if (slot < 0 || size_t(slot) >= kSlots) return nullptr;
  return &g_slots[slot].lost;
}

}  // namespace forkling::vmm::ram_guard
