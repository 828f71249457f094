#include "vmm/virtio_vsock.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "vmm/park_watch.h"

namespace forkling::vmm {
namespace {

constexpr uint64_t kListenToken = 1;
constexpr uint64_t kKickToken = 2;
constexpr size_t kHeaderSize = sizeof(VsockHeader);
constexpr size_t kMaxConnectLine = 32;  // "CONNECT 4294967295\r" fits

using Clock = std::chrono::steady_clock;

[[noreturn]] void ThrowErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

bool MakeAddr(const std::string& path, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  if (path.size() >= sizeof addr->sun_path) return false;
  std::memcpy(addr->sun_path, path.data(), path.size());
  return true;
}

uint64_t PortKey(uint32_t host_port, uint32_t guest_port) {
  return (static_cast<uint64_t>(host_port) << 32) | guest_port;
}

// "CONNECT <port>" (an optional trailing '\r' is tolerated).
bool ParseConnectLine(std::string line, uint32_t* port) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
  static const std::string kPrefix = "CONNECT ";
  if (line.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  std::string digits = line.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 10) return false;
  uint64_t v = 0;
  for (char ch : digits) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + static_cast<uint64_t>(ch - '0');
  }
  if (v > UINT32_MAX) return false;
  *port = static_cast<uint32_t>(v);
  return true;
}

// Sends up to `len` bytes of the chain's readable stream from `offset` with
// one sendmsg. Returns the bytes sent (0 when the socket is full), or -1 when
// the connection is broken.
ssize_t SendFromChain(int fd, const DescriptorChain& chain, uint64_t offset, uint64_t len) {
  iovec iov[64];
  size_t n = 0;
  for (const ChainSegment& s : chain.readable) {
    if (len == 0 || n == 64) break;
    if (offset >= s.len) {
      offset -= s.len;
      continue;
    }
    uint64_t take = std::min<uint64_t>(s.len - offset, len);
    iov[n].iov_base = s.host + offset;
    iov[n].iov_len = take;
    n++;
    len -= take;
    offset = 0;
  }
  if (n == 0) return 0;
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n;
  for (;;) {
    ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r >= 0) return r;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return -1;
  }
}

}  // namespace

struct VirtioVsock::Conn {
  enum class State { kAwaitLine, kConnecting, kConnected };
  uint64_t id = 0;
  int fd = -1;
  State state = State::kAwaitLine;
  bool has_ports = false;
  uint32_t host_port = 0;
  uint32_t guest_port = 0;
  std::string line;  // the CONNECT line read so far
  // guest -> host
  std::string to_host;  // bytes from the guest not yet written to fd
  size_t to_host_off = 0;
  uint32_t fwd_cnt = 0;  // bytes from the guest written to fd
  uint32_t last_fwd_cnt_sent = 0;
  // host -> guest
  uint32_t tx_cnt = 0;  // bytes read from fd for the guest
  uint32_t peer_buf_alloc = 0;
  uint32_t peer_fwd_cnt = 0;
  size_t queued_rx = 0;  // of tx_cnt, bytes still waiting for rx buffers
  bool credit_requested = false;
  bool credit_request_queued = false;  // one waits for an rx buffer: none more until it is delivered
  bool host_eof = false;         // fd read returned 0
  bool hup = false;              // the Unix peer closed completely (fd left epoll)
  bool guest_shut_send = false;  // the guest will send no more
  bool guest_shut_rcv = false;   // the guest will receive no more
  bool wr_shut = false;          // shutdown(fd, SHUT_WR) done
  bool close_after_flush = false;
  bool registered = true;  // in epoll
  uint32_t events = EPOLLIN;
  bool has_deadline = false;
  Clock::time_point deadline{};

  size_t pending_to_host() const { return to_host.size() - to_host_off; }
};

VirtioVsock::VirtioVsock(uint64_t guest_cid, std::string uds_path)
    : guest_cid_(guest_cid), uds_path_(std::move(uds_path)) {
  if (guest_cid_ < 3 || guest_cid_ >= 0xFFFFFFFFull)
    throw std::invalid_argument("vsock guest CID " + std::to_string(guest_cid_) +
                                " is out of range (3 to 4294967294)");
  sockaddr_un addr;
  // Room for "_<port>" on the guest-initiated paths too.
  if (uds_path_.empty() || !MakeAddr(uds_path_ + "_4294967295", &addr))
    throw std::invalid_argument("vsock socket path '" + uds_path_ + "' is empty or too long for a Unix socket (at most " +
                                std::to_string(sizeof addr.sun_path - 12) + " bytes)");
  MakeAddr(uds_path_, &addr);
  try {
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) ThrowErrno("socket");
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0) {
      if (errno != EADDRINUSE) ThrowErrno("bind " + uds_path_);
      // Replace a stale socket (nobody accepting on it); refuse anything else.
      struct stat st;
      if (lstat(uds_path_.c_str(), &st) < 0 || !S_ISSOCK(st.st_mode)) {
        errno = EADDRINUSE;
        ThrowErrno("bind " + uds_path_);
      }
      int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (probe < 0) ThrowErrno("socket");
      int rc = connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
      int err = errno;
      close(probe);
      if (rc == 0 || err != ECONNREFUSED) {
        errno = EADDRINUSE;
        ThrowErrno("bind " + uds_path_ + " (another process listens there)");
      }
      if (unlink(uds_path_.c_str()) < 0) ThrowErrno("unlink " + uds_path_);
      if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0) ThrowErrno("bind " + uds_path_);
    }
    struct stat st;
    if (stat(uds_path_.c_str(), &st) == 0) {
      uds_dev_ = st.st_dev;
      uds_ino_ = st.st_ino;
    }
    if (listen(listen_fd_, 128) < 0) ThrowErrno("listen " + uds_path_);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0) ThrowErrno("epoll_create1");
    kick_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (kick_fd_ < 0) ThrowErrno("eventfd");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenToken;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev) < 0) ThrowErrno("epoll_ctl");
    ev.data.u64 = kKickToken;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, kick_fd_, &ev) < 0) ThrowErrno("epoll_ctl");
  } catch (...) {
    if (uds_ino_ != 0) unlink(uds_path_.c_str());
    if (listen_fd_ >= 0) close(listen_fd_);
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (kick_fd_ >= 0) close(kick_fd_);
    throw;
  }
}

VirtioVsock::~VirtioVsock() {
  Reset();
  FreeReadBuffer();
  close(listen_fd_);
  close(epoll_fd_);
  close(kick_fd_);
  struct stat st;
  if (lstat(uds_path_.c_str(), &st) == 0 && st.st_dev == uds_dev_ && st.st_ino == uds_ino_) unlink(uds_path_.c_str());
}

void VirtioVsock::ReadConfig(uint32_t offset, uint8_t* data, uint32_t len) {
  // struct virtio_vsock_config { le64 guest_cid; }
  uint8_t cfg[8];
  std::memcpy(cfg, &guest_cid_, 8);
  for (uint64_t i = 0; i < len; i++) {
    uint64_t at = static_cast<uint64_t>(offset) + i;
    data[i] = at < 8 ? cfg[at] : 0;
  }
}

// ---- lifecycle --------------------------------------------------------------

void VirtioVsock::ClearRuntime() {
  CloseAll();
  rx_pending_.clear();
  rx_pending_control_ = 0;
  rx_pending_bytes_ = 0;
}

bool VirtioVsock::StartLoop(bool fail_device) {
  if (thread_.joinable()) thread_.join();  // (a parked loop's thread, ended)
  stop_ = false;
  // A kick left pending by a stopped loop would swallow every later kick.
  kick_pending_ = false;
  // A new loop makes its first pass whatever a park asked before it stopped.
  park_requested_ = false;
  running_ = true;  // before the thread: a guest kick from now on reaches it
  try {
    thread_ = VmmThread([this] { Loop(); });
  } catch (const std::system_error& e) {
    running_ = false;
    if (fail_device) FailDevice(std::string("cannot start the vsock device's thread: ") + e.what());
    return false;
  }
  // A first pass whatever happened while the loop was stopped (a kick the last loop
  // read together with its stop kick, work queued during a hold).
  WakeLoop();
  return true;
}

void VirtioVsock::WakeLoop() {
  uint64_t one = 1;
  ssize_t ignored = write(kick_fd_, &one, sizeof one);
  (void)ignored;
}

void VirtioVsock::StopLoop() {
  park_requested_ = false;
  if (parked_) {
    park_watch::Forget(park_token_, epoll_fd_);
    park_token_ = 0;
    if (thread_.joinable()) thread_.join();
    parked_ = false;
  } else {
    if (!running_) return;
    stop_ = true;
    WakeLoop();
    thread_.join();
    running_ = false;
    stop_ = false;
  }
  std::lock_guard<std::mutex> l(sync_mu_);
  sync_done_ = sync_requested_;
  sync_cv_.notify_all();
}

void VirtioVsock::Activate(const GuestMemory& mem, const std::vector<QueueConfig>& queues, uint64_t driver_features,
                           NotifyGuest notify_guest) {
  std::lock_guard<std::mutex> l(control_mu_);
  StopLoop();
  ClearRuntime();
  mem_ = mem;
  driver_features_ = driver_features;
  notify_ = std::move(notify_guest);
  event_reset_owed_ = false;
  transport_reset_pending_ = false;
  active_ = false;
  static const char* kNames[3] = {"vsock rx queue", "vsock tx queue", "vsock event queue"};
  const bool indirect = (driver_features & kVirtioFIndirectDesc) != 0;
  for (uint16_t i = 0; i < 3; i++) {
    QueueConfig cfg = i < queues.size() ? queues[i] : QueueConfig();
    std::string err = queues_[i].Init(mem, cfg, kQueueSize, indirect, kNames[i]);
    if (!err.empty()) {
      for (Virtqueue& q : queues_) q.Clear();
      Fail(err);
      return;
    }
  }
  active_ = true;
  if (!paused_) StartLoop();  // held by the VMM: Resume() starts it
}

void VirtioVsock::Reset() {
  std::lock_guard<std::mutex> l(control_mu_);
  StopLoop();
  ClearRuntime();
  for (Virtqueue& q : queues_) q.Clear();
  notify_ = nullptr;
  mem_ = GuestMemory();
  driver_features_ = 0;
  event_reset_owed_ = false;
  transport_reset_pending_ = false;
  active_ = false;
  ClearFailure();
}

// A hold of the VMM's (a snapshot, a reclaim), which the guest cannot end: a reset
// and new activation by the guest in between does not start the loop.
void VirtioVsock::Pause() {
  std::lock_guard<std::mutex> l(control_mu_);
  paused_ = true;
  StopLoop();
}

void VirtioVsock::Resume() {
  std::lock_guard<std::mutex> l(control_mu_);
  paused_ = false;
  if (active_ && !running_ && !parked_) StartLoop();
}

VirtioVsock::State VirtioVsock::SaveState() const {
  std::lock_guard<std::mutex> l(control_mu_);
  State s;
  s.guest_cid = guest_cid_;
  s.active = active_;
  s.driver_features = driver_features_;
  for (int i = 0; i < 3; i++) s.queues[i] = queues_[i].state();
  s.next_host_port = next_host_port_;
  return s;
}

void VirtioVsock::RestoreState(const GuestMemory& mem, const State& state, NotifyGuest notify_guest) {
  std::lock_guard<std::mutex> l(control_mu_);
  StopLoop();
  ClearRuntime();
  for (Virtqueue& q : queues_) q.Clear();
  ClearFailure();
  active_ = false;
  paused_ = false;  // the VMM starts this device over
  mem_ = mem;
  driver_features_ = state.driver_features;
  notify_ = std::move(notify_guest);
  next_host_port_ = state.next_host_port < kFirstHostPort ? kFirstHostPort : state.next_host_port;
  if (!state.active) return;
  static const char* kNames[3] = {"vsock rx queue", "vsock tx queue", "vsock event queue"};
  const bool indirect = (state.driver_features & kVirtioFIndirectDesc) != 0;
  for (int i = 0; i < 3; i++) {
    std::string err = queues_[i].Restore(mem, state.queues[i], kQueueSize, indirect, kNames[i]);
    if (!err.empty()) {
      for (Virtqueue& q : queues_) q.Clear();
      Fail(err);
      return;
    }
  }
  // The guest still believes in connections the restored device does not have.
  event_reset_owed_ = true;
  active_ = true;
  StartLoop();
}

void VirtioVsock::Kick() {
  if (!kick_pending_.exchange(true)) {
    WakeLoop();
  }
}

// (a parked loop's kick reaches the park watch through epoll_fd_, which starts the loop)
void VirtioVsock::QueueNotify(uint16_t queue) {
  if (queue < 3 && (running_ || parked_)) Kick();
}

void VirtioVsock::TransportReset() {
  transport_reset_pending_ = true;
  if (running_ || parked_) Kick();
}

bool VirtioVsock::Sync(int timeout_ms) {
  std::unique_lock<std::mutex> l(sync_mu_);
  if (!running_ && !parked_) return true;
  const uint64_t target = ++sync_requested_;
  l.unlock();
  // Not coalesced with kicks: the pass must start after sync_requested_ grew.
  WakeLoop();
  l.lock();
  return sync_cv_.wait_for(l, std::chrono::milliseconds(timeout_ms),
                           [&] { return sync_done_ >= target || (!running_ && !parked_); });
}

VirtioVsock::Stats VirtioVsock::stats() const {
  return Stats{counters_.tx_packets.load(),  counters_.rx_packets.load(),      counters_.bad_packets.load(),
               counters_.resets_sent.load(), counters_.dropped_control.load(), counters_.connections.load(),
               parked_ ? 1u : 0u,           counters_.parks.load(),       counters_.park_refusals.load()};
}

// ---- parking ----------------------------------------------------------------

void VirtioVsock::FreeReadBuffer() {
  if (read_buf_) munmap(read_buf_, kMaxPacketPayload);
  read_buf_ = nullptr;
}

void VirtioVsock::RequestPark() {
  park_requested_ = true;
  if (running_) WakeLoop();
}

uint64_t VirtioVsock::WatchWhileParked() {
  std::weak_ptr<VirtioVsock> self = weak_from_this();
  if (self.expired()) return 0;  // (not owned by a shared_ptr: the watch could outlive it)
  return park_watch::Watch(epoll_fd_, [self](uint64_t t) {
    if (auto dev = self.lock()) dev->Unpark(t);
  });
}

VirtioVsock::ParkResult VirtioVsock::TryPark() {
  // A pass is owed for a guest kick, a sync or a transport reset since the last one (each sets
  // its flag before it writes kick_fd_, and the loop calls this after it drained kick_fd_).
  if (kick_pending_ || transport_reset_pending_) return ParkResult::kOwed;
  {
    std::lock_guard<std::mutex> s(sync_mu_);
    if (sync_requested_ > sync_done_) return ParkResult::kOwed;
  }
  if (failed() || event_reset_owed_ || !rx_pending_.empty()) return ParkResult::kNotIdle;
  for (const auto& [id, c] : conns_) {
    if (c->has_deadline) return ParkResult::kNotIdle;  // (only a pass sees these)
    // A connection whose host end closed is read and flushed by each pass (it left epoll) until
    // it is done both ways or waits for the guest.
    if (c->hup && (c->pending_to_host() > 0 || (c->state == Conn::State::kConnected && !c->host_eof && !c->guest_shut_rcv)))
      return ParkResult::kNotIdle;
  }
  // A control call under way (Pause, Reset, SaveState, ...) decides about the loop itself.
  std::unique_lock<std::mutex> l(control_mu_, std::try_to_lock);
  if (!l.owns_lock()) return ParkResult::kBusy;
  if (stop_ || paused_ || !active_) return ParkResult::kNotIdle;
  // (A kick, sync or transport reset from now on writes kick_fd_, which the watch sees; the loop
  // it starts clears kick_pending_.)
  parked_ = true;  // (before running_ goes false: Kick and Sync see one of the two)
  const uint64_t token = WatchWhileParked();
  if (token == 0) {
    parked_ = false;
    return ParkResult::kNotIdle;  // (it keeps its thread)
  }
  park_token_ = token;
  running_ = false;
  counters_.parks++;
  // What a parked loop needs no more goes back to the system (not to an arena of malloc's,
  // where its pages would stay ours): the read buffer, and what idle connections kept of theirs.
  FreeReadBuffer();
  for (auto& [id, c] : conns_)
    if (c->pending_to_host() == 0) {
      std::string().swap(c->to_host);
      c->to_host_off = 0;
    }
  return ParkResult::kParked;
}

void VirtioVsock::Unpark(uint64_t token) {
  {
    std::lock_guard<std::mutex> l(control_mu_);
    if (!parked_ || token != park_token_) return;  // (stopped or started since: an old token)
    park_token_ = 0;
    // (StartLoop joins the parked thread first.) No thread to be had now (EAGAIN: a pids or
    // thread limit, memory): it stays parked and the watch tries again, rather than failing
    // the device while it idles.
    if (active_ && !paused_ && !StartLoop(/*fail_device=*/false)) {
      try {
        park_token_ = WatchWhileParked();
      } catch (...) {  // (out of memory for the watch's entry)
      }
      if (park_token_ == 0) {
        parked_ = false;
        FailDevice("vsock: cannot start the device's thread again after a park");
      }
    }
    if (park_token_ == 0) {
      if (thread_.joinable() && !running_) thread_.join();
      parked_ = false;
      std::lock_guard<std::mutex> s(sync_mu_);
      sync_cv_.notify_all();  // (a Sync waiting on a loop that could not start)
      return;
    }
  }
  // (on the watch's thread: its fd still reads ready, so the next try comes at once)
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

void VirtioVsock::FailDevice(const std::string& message) {
  Fail(message);
  CloseAll();
  rx_pending_.clear();
  rx_pending_control_ = 0;
  rx_pending_bytes_ = 0;
}

// ---- the event loop ---------------------------------------------------------

void VirtioVsock::Loop() {
  pthread_setname_np(pthread_self(), "vsock");
  // Started by Unpark: no longer parked from before its first pass, so whoever sees what the
  // pass answers sees that too (Unpark clears it again only after StartLoop returned).
  parked_ = false;
  epoll_event events[64];
  while (!stop_) {
    // (a park asked for is tried again in 1 ms while a control call or a pass is in its way)
    int n = epoll_wait(epoll_fd_, events, 64, park_requested_ ? 1 : NextTimeoutMs());
    if (n < 0) {
      if (errno == EINTR) continue;
      FailDevice(std::string("vsock: epoll_wait failed: ") + std::strerror(errno));
      break;
    }
    // A park asked for (RequestPark), and only kicks woke the loop (or none): park before a pass,
    // which would write a packed VM's pages back (BeforePass) for nothing.
    if (park_requested_ && !stop_) {
      bool only_kicks = true;
      for (int i = 0; i < n; i++) only_kicks = only_kicks && events[i].data.u64 == kKickToken;
      if (only_kicks) {
        uint64_t v;
        ssize_t ignored = read(kick_fd_, &v, sizeof v);
        (void)ignored;
        ParkResult p;
        try {
          p = TryPark();
        } catch (...) {  // (out of memory for the watch's entry: it keeps its thread)
          p = ParkResult::kNotIdle;
        }
        if (p == ParkResult::kParked) return;  // (the thread ends; the park watch starts another)
        // Refused (a deadline, a connection the host closed, packets for the guest): no pass
        // either, and it waits as before. Busy (a control call): tried again. Owed: the pass
        // comes first, and the park is tried after it (unless it woke a packed VM: CancelPark).
        if (p == ParkResult::kNotIdle) {
          park_requested_ = false;
          counters_.park_refusals++;
        }
        if (p != ParkResult::kOwed) continue;
      }
    }
    // An exception here (out of memory while queueing for a guest) would end Node
    // (std::terminate on this thread): it fails this device instead.
    auto guarded = [this](auto&& fn) {
      try {
        fn();
      } catch (const std::exception& e) {
        try {
          FailDevice(std::string("vsock: internal error: ") + e.what());
        } catch (...) {
        }
      } catch (...) {
        try {
          FailDevice("vsock: internal error");
        } catch (...) {
        }
      }
    };
    std::lock_guard<std::mutex> pass(pass_mu_);
    if (before_pass_) guarded(before_pass_);
    guarded([&] {
      for (int i = 0; i < n && !stop_; i++) {
        const uint64_t token = events[i].data.u64;
        if (token == kKickToken) {
          uint64_t v;
          ssize_t ignored = read(kick_fd_, &v, sizeof v);
          (void)ignored;
        } else if (token == kListenToken) {
          if (on_host_input_) on_host_input_();
          AcceptAll();
        } else {
          if (on_host_input_) on_host_input_();
          HandleConnEvent(token, events[i].events);
        }
      }
    });
    if (stop_) break;
    kick_pending_ = false;
    uint64_t sync_target;
    {
      std::lock_guard<std::mutex> l(sync_mu_);
      sync_target = sync_requested_;
    }
    guarded([&] { Pass(); });
    if (mem_.lost()) {  // (what it read of the rings were zeros: vmm/ram_guard.h; the VM stops on this failure)
      FailDevice("vsock: guest RAM lost (a file it maps was cut short or could not be read)");
      break;
    }
    {
      std::lock_guard<std::mutex> l(sync_mu_);
      if (sync_target > sync_done_) sync_done_ = sync_target;
    }
    sync_cv_.notify_all();
  }
}

void VirtioVsock::Pass() {
  if (failed()) {
    CloseAll();
    return;
  }
  if (transport_reset_pending_.exchange(false)) {
    ClearRuntime();
    event_reset_owed_ = true;
  }
  ProcessTx();
  if (failed()) return;
  // Connections whose Unix peer has gone (no longer in epoll) are read here.
  std::vector<uint64_t> ids;
  for (auto& [id, c] : conns_)
    if (c->hup) ids.push_back(id);
  for (uint64_t id : ids) {
    Conn* c = FindId(id);
    if (c && c->state == Conn::State::kConnected) {
      if (c->pending_to_host() > 0) FlushToHost(c);
      if ((c = FindId(id)) != nullptr) ReadFromHost(c);
    }
  }
  CheckDeadlines();
  DeliverRx();
  if (failed()) return;
  DeliverEvents();
  if (failed()) return;
  for (auto& [id, c] : conns_) UpdateInterest(c.get());
}

int VirtioVsock::NextTimeoutMs() const {
  bool any = false;
  Clock::time_point first{};
  for (const auto& [id, c] : conns_) {
    if (c->has_deadline && (!any || c->deadline < first)) {
      first = c->deadline;
      any = true;
    }
  }
  if (!any) return -1;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(first - Clock::now()).count() + 1;
  return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 60000));
}

void VirtioVsock::CheckDeadlines() {
  const Clock::time_point now = Clock::now();
  std::vector<uint64_t> expired;
  for (auto& [id, c] : conns_)
    if (c->has_deadline && c->deadline <= now) expired.push_back(id);
  for (uint64_t id : expired) {
    Conn* c = FindId(id);
    if (!c) continue;
    if (c->state == Conn::State::kConnecting)
      ResetConn(c);  // the RST also cancels a late answer from the guest
    else
      CloseConn(c);
  }
}

// ---- guest -> device --------------------------------------------------------

void VirtioVsock::ProcessTx() {
  Virtqueue& q = queues_[kTxQueue];
  bool pushed = false;
  for (int i = 0; i < kMaxTxPerPass; i++) {
    std::string err;
    Virtqueue::PopResult r = q.Pop(&chain_, &err);
    if (r == Virtqueue::PopResult::kEmpty) break;
    if (r == Virtqueue::PopResult::kError) {
      FailDevice(err);
      return;
    }
    counters_.tx_packets++;
    VsockHeader h;
    if (chain_.readable_len < kHeaderSize) {
      counters_.bad_packets++;  // no header: nothing to answer
    } else {
      chain_.Read(0, &h, kHeaderSize);
      if (h.len > kMaxPacketPayload || h.len > chain_.readable_len - kHeaderSize) {
        counters_.bad_packets++;
        if (h.op != kVsockOpRst && h.src_cid == guest_cid_ && h.dst_cid == kVsockHostCid) {
          if (Conn* c = FindConn(h.dst_port, h.src_port))
            ResetConn(c);
          else
            QueueRst(h.dst_port, h.src_port);
        }
      } else {
        HandlePacket(h, chain_);
      }
    }
    q.PushUsed(chain_.head, 0);
    pushed = true;
    if (i + 1 == kMaxTxPerPass) Kick();  // more may be waiting: come back after host I/O
  }
  if (pushed && notify_ && q.ShouldNotify()) notify_(kTxQueue);
}

void VirtioVsock::HandlePacket(const VsockHeader& h, const DescriptorChain& chain) {
  if (h.src_cid != guest_cid_ || h.dst_cid != kVsockHostCid) {
    counters_.bad_packets++;  // not from our guest, or not for the host: drop
    return;
  }
  if (h.type != kVsockTypeStream) {
    counters_.bad_packets++;
    if (h.op != kVsockOpRst) QueueRst(h.dst_port, h.src_port);
    return;
  }
  Conn* c = FindConn(h.dst_port, h.src_port);
  if (c) {
    // Every packet carries the sender's credit.
    c->peer_buf_alloc = h.buf_alloc;
    c->peer_fwd_cnt = h.fwd_cnt;
    c->credit_requested = false;
  }
  const bool connected = c && c->state == Conn::State::kConnected;
  switch (h.op) {
    case kVsockOpRequest:
      if (c) {
        counters_.bad_packets++;
        ResetConn(c);
      } else {
        GuestConnect(h);
      }
      return;
    case kVsockOpResponse: {
      if (!c || c->state != Conn::State::kConnecting) {
        counters_.bad_packets++;
        if (c)
          ResetConn(c);
        else
          QueueRst(h.dst_port, h.src_port);
        return;
      }
      c->state = Conn::State::kConnected;
      c->has_deadline = false;
      // The Unix side has read nothing from us yet, so this short line fits
      // its socket buffer whole; anything else means the client is gone.
      std::string ok = "OK " + std::to_string(c->host_port) + "\n";
      ssize_t n = send(c->fd, ok.data(), ok.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n != static_cast<ssize_t>(ok.size())) ResetConn(c);
      return;
    }
    case kVsockOpRst:
      if (c) CloseConn(c);
      return;
    case kVsockOpShutdown:
      if (!connected) {
        if (c)
          ResetConn(c);
        else
          QueueRst(h.dst_port, h.src_port);
        return;
      }
      if (h.flags & kVsockShutdownRcv) c->guest_shut_rcv = true;
      if (h.flags & kVsockShutdownSend) c->guest_shut_send = true;
      // A full shutdown is the guest closing: answer with RST once its data is out.
      if (c->guest_shut_rcv && c->guest_shut_send) c->close_after_flush = true;
      FlushToHost(c);
      return;
    case kVsockOpRw: {
      if (!connected) {
        counters_.bad_packets++;
        if (c)
          ResetConn(c);
        else
          QueueRst(h.dst_port, h.src_port);
        return;
      }
      if (h.len == 0) return;
      if (c->guest_shut_send || c->pending_to_host() + h.len > kBufAlloc) {
        // Data after its own shutdown, or beyond the credit we gave it.
        counters_.bad_packets++;
        ResetConn(c);
        return;
      }
      uint64_t sent = 0;
      if (mem_.lost()) return;  // (zeros now: never sent as data; the loop fails the device)
      if (c->pending_to_host() == 0) {
        // Nothing queued before it: send straight from guest memory.
        ssize_t n = SendFromChain(c->fd, chain, kHeaderSize, h.len);
        if (n < 0 && errno == EFAULT) {
          // The kernel could not read guest RAM (a file it maps was cut short): the VM stops.
          FailDevice("vsock: guest RAM could not be read (EFAULT)");
          return;
        }
        if (n < 0) {
          ResetConn(c);  // EPIPE / ECONNRESET: the client is gone
          return;
        }
        sent = static_cast<uint64_t>(n);
        c->fwd_cnt += static_cast<uint32_t>(n);
        c->to_host.clear();
        c->to_host_off = 0;
      }
      if (sent < h.len) {
        size_t at = c->to_host.size();
        c->to_host.resize(at + (h.len - sent));
        chain.Read(kHeaderSize + sent, c->to_host.data() + at, h.len - sent);
        if (mem_.lost()) return;  // (what it read may be zeros: not sent; the loop fails the device)
      }
      FlushToHost(c);
      return;
    }
    case kVsockOpCreditUpdate:
      if (!c) QueueRst(h.dst_port, h.src_port);
      return;
    case kVsockOpCreditRequest:
      if (connected)
        QueueControl(kVsockOpCreditUpdate, 0, c);
      else if (!c)
        QueueRst(h.dst_port, h.src_port);
      return;
    default:
      counters_.bad_packets++;
      if (c)
        ResetConn(c);
      else
        QueueRst(h.dst_port, h.src_port);
      return;
  }
}

void VirtioVsock::GuestConnect(const VsockHeader& h) {
  if (conns_.size() >= kMaxConnections) {
    QueueRst(h.dst_port, h.src_port);
    return;
  }
  sockaddr_un addr;
  MakeAddr(uds_path_ + "_" + std::to_string(h.dst_port), &addr);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0) {
    // Nobody listens there (or its backlog is full): refuse.
    if (fd >= 0) close(fd);
    QueueRst(h.dst_port, h.src_port);
    return;
  }
  auto c = std::make_unique<Conn>();
  c->id = next_conn_id_++;
  c->fd = fd;
  c->state = Conn::State::kConnected;
  c->has_ports = true;
  c->host_port = h.dst_port;
  c->guest_port = h.src_port;
  c->peer_buf_alloc = h.buf_alloc;
  c->peer_fwd_cnt = h.fwd_cnt;
  epoll_event ev{};
  ev.events = c->events;
  ev.data.u64 = c->id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) < 0) {
    close(fd);
    QueueRst(h.dst_port, h.src_port);
    return;
  }
  Conn* raw = c.get();
  by_ports_[PortKey(raw->host_port, raw->guest_port)] = raw;
  conns_[raw->id] = std::move(c);
  counters_.connections++;
  QueueControl(kVsockOpResponse, 0, raw);
}

// ---- host side --------------------------------------------------------------

void VirtioVsock::AcceptAll() {
  for (;;) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN, or out of descriptors (the client waits in the backlog)
    }
    if (failed() || conns_.size() >= kMaxConnections || !queues_[kRxQueue].ready()) {
      close(fd);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->id = next_conn_id_++;
    c->fd = fd;
    c->state = Conn::State::kAwaitLine;
    c->has_deadline = true;
    c->deadline = Clock::now() + std::chrono::milliseconds(kConnectTimeoutMs);
    epoll_event ev{};
    ev.events = c->events;
    ev.data.u64 = c->id;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) < 0) {
      close(fd);
      continue;
    }
    counters_.connections++;
    conns_[c->id] = std::move(c);
  }
}

void VirtioVsock::HandleConnEvent(uint64_t id, uint32_t events) {
  Conn* c = FindId(id);
  if (!c) return;  // closed earlier in this batch
  if (events & EPOLLERR) {
    ResetConn(c);
    return;
  }
  if (events & EPOLLHUP) c->hup = true;  // the peer closed; UpdateInterest takes the fd out of epoll
  switch (c->state) {
    case Conn::State::kAwaitLine:
      ReadConnectLine(c);
      return;
    case Conn::State::kConnecting:
      if (c->hup) ResetConn(c);  // the client gave up before the guest answered
      return;
    case Conn::State::kConnected:
      if ((events & EPOLLOUT) || c->hup) FlushToHost(c);
      if ((c = FindId(id)) != nullptr && ((events & EPOLLIN) || c->hup)) ReadFromHost(c);
      return;
  }
}

void VirtioVsock::ReadConnectLine(Conn* c) {
  // Byte by byte: whatever follows the line belongs to the stream.
  for (;;) {
    char ch;
    ssize_t n = recv(c->fd, &ch, 1, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      CloseConn(c);
      return;
    }
    if (n == 0) {
      CloseConn(c);  // gone before saying where to connect
      return;
    }
    if (ch != '\n') {
      c->line.push_back(ch);
      if (c->line.size() > kMaxConnectLine) {
        CloseConn(c);
        return;
      }
      continue;
    }
    uint32_t port;
    if (!ParseConnectLine(c->line, &port)) {
      static const char kErr[] = "ERROR expected \"CONNECT <port>\\n\"\n";
      ssize_t ignored = send(c->fd, kErr, sizeof kErr - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)ignored;
      CloseConn(c);
      return;
    }
    uint32_t host_port;
    do {
      host_port = next_host_port_++;
      if (next_host_port_ < kFirstHostPort) next_host_port_ = kFirstHostPort;
    } while (by_ports_.count(PortKey(host_port, port)) != 0);
    c->line.clear();
    c->has_ports = true;
    c->host_port = host_port;
    c->guest_port = port;
    by_ports_[PortKey(host_port, port)] = c;
    c->state = Conn::State::kConnecting;
    c->deadline = Clock::now() + std::chrono::milliseconds(kConnectTimeoutMs);
    QueueControl(kVsockOpRequest, 0, c);
    return;
  }
}

uint32_t VirtioVsock::PeerCredit(const Conn* c) const {
  const uint32_t in_flight = c->tx_cnt - c->peer_fwd_cnt;
  return in_flight >= c->peer_buf_alloc ? 0 : c->peer_buf_alloc - in_flight;
}

size_t VirtioVsock::RxRoomAll() const {
  if (rx_pending_bytes_ >= kMaxQueuedTotal || rx_pending_.size() >= kMaxQueuedPackets) return 0;
  return kMaxQueuedTotal - rx_pending_bytes_;
}

void VirtioVsock::ReadFromHost(Conn* c) {
  const uint64_t id = c->id;
  while (c->state == Conn::State::kConnected && !c->host_eof && !c->guest_shut_rcv) {
    size_t room_conn = c->queued_rx < kMaxQueuedPerConn ? kMaxQueuedPerConn - c->queued_rx : 0;
    const size_t room_all = RxRoomAll();
    const uint32_t credit = PeerCredit(c);
    size_t want = std::min<size_t>({credit, room_conn, room_all, kMaxPacketPayload});
    if (want == 0) {
      if (credit == 0 && !c->credit_requested && !c->credit_request_queued) {
        c->credit_requested = true;
        c->credit_request_queued = QueueControl(kVsockOpCreditRequest, 0, c);
      }
      return;
    }
    if (!read_buf_) {
      void* p = mmap(nullptr, kMaxPacketPayload, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();  // (the loop fails this device)
      read_buf_ = static_cast<char*>(p);
    }
    ssize_t n = recv(c->fd, read_buf_, want, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      ResetConn(c);
      return;
    }
    if (n == 0) {
      c->host_eof = true;
      // The client can no longer receive either when it closed completely.
      QueueControl(kVsockOpShutdown, kVsockShutdownSend | (c->hup ? kVsockShutdownRcv : 0), c);
      if (c->guest_shut_send && c->pending_to_host() == 0) ResetConn(c);  // both directions are done
      return;
    }
    // Appended to this connection's data packet still waiting near the end of the
    // line (past credit packets only, which may come before data): the limits
    // count bytes, and a guest granting credit a byte at a time would otherwise
    // queue a packet (~100 bytes of the host's) per byte.
    Packet* last = nullptr;
    for (auto it = rx_pending_.rbegin(); it != rx_pending_.rend() && it - rx_pending_.rbegin() < 4; ++it) {
      if (it->hdr.op == kVsockOpRw) {
        if (it->conn_id == id) last = &*it;
        break;
      }
      if (it->hdr.op != kVsockOpCreditRequest && it->hdr.op != kVsockOpCreditUpdate) break;
    }
    if (last && last->data.size() - last->off + static_cast<size_t>(n) <= kMaxPacketPayload) {
      last->data.erase(0, last->off);  // (what was delivered goes: the packet stays bounded)
      last->off = 0;
      last->data.append(read_buf_, static_cast<size_t>(n));
    } else {
      Packet p;
      p.hdr = VsockHeader{kVsockHostCid, guest_cid_, c->host_port, c->guest_port, 0, kVsockTypeStream, kVsockOpRw, 0,
                          kBufAlloc, 0};
      p.data.assign(read_buf_, static_cast<size_t>(n));
      p.conn_id = id;
      rx_pending_.push_back(std::move(p));
    }
    c->tx_cnt += static_cast<uint32_t>(n);
    c->queued_rx += static_cast<size_t>(n);
    rx_pending_bytes_ += static_cast<size_t>(n);
    if (static_cast<size_t>(n) < want) return;  // drained for now
  }
}

void VirtioVsock::FlushToHost(Conn* c) {
  while (c->pending_to_host() > 0) {
    ssize_t n = send(c->fd, c->to_host.data() + c->to_host_off, c->pending_to_host(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      ResetConn(c);  // EPIPE / ECONNRESET: the client is gone
      return;
    }
    c->to_host_off += static_cast<size_t>(n);
    c->fwd_cnt += static_cast<uint32_t>(n);
  }
  if (c->pending_to_host() == 0) {
    c->to_host.clear();
    c->to_host_off = 0;
  } else if (c->to_host_off > 64 * 1024) {
    c->to_host.erase(0, c->to_host_off);
    c->to_host_off = 0;
  }
  MaybeCreditUpdate(c);
  if (c->pending_to_host() != 0) return;
  if (c->close_after_flush) {
    ResetConn(c);
    return;
  }
  if (c->guest_shut_send && !c->wr_shut) {
    shutdown(c->fd, SHUT_WR);
    c->wr_shut = true;
  }
  if (c->guest_shut_send && c->host_eof) ResetConn(c);  // both directions are done
}

void VirtioVsock::MaybeCreditUpdate(Conn* c) {
  if (c->state != Conn::State::kConnected) return;
  if (c->fwd_cnt - c->last_fwd_cnt_sent < kBufAlloc / 4) return;
  c->last_fwd_cnt_sent = c->fwd_cnt;
  QueueControl(kVsockOpCreditUpdate, 0, c);
}

void VirtioVsock::UpdateInterest(Conn* c) {
  if (c->hup) {
    if (c->registered) {
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
      c->registered = false;
    }
    return;
  }
  uint32_t want = 0;
  switch (c->state) {
    case Conn::State::kAwaitLine:
      want = EPOLLIN;
      break;
    case Conn::State::kConnecting:
      break;  // HUP is reported anyway
    case Conn::State::kConnected:
      if (!c->host_eof && !c->guest_shut_rcv && PeerCredit(c) > 0 && c->queued_rx < kMaxQueuedPerConn && RxRoomAll() > 0)
        want |= EPOLLIN;
      if (c->pending_to_host() > 0) want |= EPOLLOUT;
      break;
  }
  if (want == c->events) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c->id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &ev) == 0) c->events = want;
}

// ---- device -> guest --------------------------------------------------------

bool VirtioVsock::QueueControl(uint16_t op, uint32_t flags, const Conn* c) {
  if (rx_pending_control_ >= kMaxQueuedControl) {
    counters_.dropped_control++;
    return false;
  }
  Packet p;
  p.hdr = VsockHeader{kVsockHostCid, guest_cid_, c->host_port, c->guest_port, 0, kVsockTypeStream, op, flags,
                      kBufAlloc, c->fwd_cnt};
  p.conn_id = c->id;
  if (op == kVsockOpRst) counters_.resets_sent++;
  rx_pending_control_++;
  rx_pending_.push_back(std::move(p));
  return true;
}

void VirtioVsock::QueueRst(uint32_t host_port, uint32_t guest_port) {
  if (rx_pending_control_ >= kMaxQueuedControl) {
    counters_.dropped_control++;
    return;
  }
  Packet p;
  p.hdr = VsockHeader{kVsockHostCid, guest_cid_, host_port, guest_port, 0, kVsockTypeStream, kVsockOpRst, 0, 0, 0};
  counters_.resets_sent++;
  rx_pending_control_++;
  rx_pending_.push_back(std::move(p));
}

void VirtioVsock::DeliverRx() {
  Virtqueue& q = queues_[kRxQueue];
  bool pushed = false;
  while (!rx_pending_.empty()) {
    Packet& p = rx_pending_.front();
    const bool rw = p.hdr.op == kVsockOpRw;
    Conn* c = p.conn_id ? FindId(p.conn_id) : nullptr;
    if (rw && !c) {  // its connection is gone: the data goes with it
      rx_pending_bytes_ -= p.data.size() - p.off;
      rx_pending_.pop_front();
      continue;
    }
    std::string err;
    Virtqueue::PopResult r = q.Pop(&chain_, &err);
    if (r == Virtqueue::PopResult::kEmpty) break;
    if (r == Virtqueue::PopResult::kError) {
      FailDevice(err);
      return;
    }
    if (chain_.writable_len < kHeaderSize + (rw ? 1 : 0)) {
      FailDevice("vsock rx queue: buffer of " + std::to_string(chain_.writable_len) +
                 " writable bytes is too small for a packet");
      return;
    }
    VsockHeader h = p.hdr;
    if (c) {
      h.buf_alloc = kBufAlloc;
      h.fwd_cnt = c->fwd_cnt;
      c->last_fwd_cnt_sent = c->fwd_cnt;
    }
    uint64_t n = 0;
    if (rw) {
      n = std::min<uint64_t>(p.data.size() - p.off, chain_.writable_len - kHeaderSize);
      chain_.Write(kHeaderSize, p.data.data() + p.off, n);
      h.len = static_cast<uint32_t>(n);
    }
    chain_.Write(0, &h, kHeaderSize);
    q.PushUsed(chain_.head, static_cast<uint32_t>(kHeaderSize + n));
    pushed = true;
    counters_.rx_packets++;
    if (rw) {
      p.off += n;
      c->queued_rx -= n;
      rx_pending_bytes_ -= n;
      if (p.off == p.data.size()) rx_pending_.pop_front();
    } else {
      if (c && p.hdr.op == kVsockOpCreditRequest) c->credit_request_queued = false;
      rx_pending_control_--;
      rx_pending_.pop_front();
    }
  }
  if (pushed && notify_ && q.ShouldNotify()) notify_(kRxQueue);
}

void VirtioVsock::DeliverEvents() {
  if (!event_reset_owed_) return;
  Virtqueue& q = queues_[kEventQueue];
  std::string err;
  Virtqueue::PopResult r = q.Pop(&chain_, &err);
  if (r == Virtqueue::PopResult::kEmpty) return;
  if (r == Virtqueue::PopResult::kError) {
    FailDevice(err);
    return;
  }
  if (chain_.writable_len < 4) {
    FailDevice("vsock event queue: buffer of " + std::to_string(chain_.writable_len) +
               " writable bytes is too small for an event");
    return;
  }
  const uint32_t id = kVsockEventTransportReset;
  chain_.Write(0, &id, 4);
  q.PushUsed(chain_.head, 4);
  event_reset_owed_ = false;
  if (notify_ && q.ShouldNotify()) notify_(kEventQueue);
}

// ---- connections ------------------------------------------------------------

VirtioVsock::Conn* VirtioVsock::FindConn(uint32_t host_port, uint32_t guest_port) {
  auto it = by_ports_.find(PortKey(host_port, guest_port));
  return it == by_ports_.end() ? nullptr : it->second;
}

VirtioVsock::Conn* VirtioVsock::FindId(uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void VirtioVsock::ResetConn(Conn* c) {
  if (c->has_ports) QueueControl(kVsockOpRst, 0, c);
  CloseConn(c);
}

void VirtioVsock::CloseConn(Conn* c) {
  if (c->registered) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  close(c->fd);
  if (c->has_ports) {
    auto it = by_ports_.find(PortKey(c->host_port, c->guest_port));
    if (it != by_ports_.end() && it->second == c) by_ports_.erase(it);
  }
  counters_.connections--;
  conns_.erase(c->id);  // destroys c
}

void VirtioVsock::CloseAll() {
  while (!conns_.empty()) CloseConn(conns_.begin()->second.get());
}

}  // namespace forkling::vmm
