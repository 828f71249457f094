// virtio-vsock (device id 19): the guest's AF_VSOCK stream sockets, bridged
// to Unix stream sockets on the host.
//
//   host -> guest: the host connects to the Unix socket `uds_path` and writes
//     "CONNECT <port>\n"; the device asks the guest to connect to <port> from
//     a fresh host port; when the guest accepts, the device writes
//     "OK <host port>\n" and then bridges bytes both ways. When the guest
//     refuses (or does not answer in time) the Unix connection is closed.
//   guest -> host: a guest connection to CID 2 port P is bridged to the Unix
//     socket "<uds_path>_<P>"; the guest gets a reset when nothing listens.
//
// Credit flow control follows the virtio spec (buf_alloc / fwd_cnt): the
// device never sends the guest more than it has room for, and resets a
// connection whose guest sends beyond the credit the device gave it.
//
// Threading: one event-loop thread per device (started by Activate, stopped
// by Reset and the destructor) owns the queues and all connections; vCPU
// threads only kick it through an eventfd. notify_guest and the failure
// callback are called on that thread and must not call Reset. While its VM is
// shelved the loop may park: its thread ends and the process's park watch
// (park_watch.h) starts it again when anything happens (a kick included).
//
// Guest packets are checked: a malformed descriptor chain fails the device;
// a malformed packet (short header, length beyond the buffer or 64 KiB,
// wrong CIDs, type or op) is dropped or answered with a reset, and counted.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vmm/virtio_device.h"
#include "vmm/virtqueue.h"
#include "vmm/vmm_thread.h"

namespace forkling::vmm {

// struct virtio_vsock_hdr (little-endian, packed, 44 bytes).
struct __attribute__((packed)) VsockHeader {
  uint64_t src_cid;
  uint64_t dst_cid;
  uint32_t src_port;
  uint32_t dst_port;
  uint32_t len;
  uint16_t type;
  uint16_t op;
  uint32_t flags;
  uint32_t buf_alloc;
  uint32_t fwd_cnt;
};
static_assert(sizeof(VsockHeader) == 44);

inline constexpr uint64_t kVsockHostCid = 2;
inline constexpr uint16_t kVsockTypeStream = 1;
enum VsockOp : uint16_t {
  kVsockOpInvalid = 0,
  kVsockOpRequest = 1,
  kVsockOpResponse = 2,
  kVsockOpRst = 3,
  kVsockOpShutdown = 4,
  kVsockOpRw = 5,
  kVsockOpCreditUpdate = 6,
  kVsockOpCreditRequest = 7,
};
inline constexpr uint32_t kVsockShutdownRcv = 1;
inline constexpr uint32_t kVsockShutdownSend = 2;
inline constexpr uint32_t kVsockEventTransportReset = 0;

class VirtioVsock : public VirtioDevice, public std::enable_shared_from_this<VirtioVsock> {
 public:
  static constexpr uint16_t kQueueSize = 256;
  static constexpr uint16_t kRxQueue = 0, kTxQueue = 1, kEventQueue = 2;
  // Bytes the device buffers per connection for data from the guest (the
  // credit it advertises).
  static constexpr uint32_t kBufAlloc = 256 * 1024;
  static constexpr uint32_t kMaxPacketPayload = 64 * 1024;
  static constexpr size_t kMaxConnections = 1024;
  // How long a host connection may take to send its CONNECT line, and the
  // guest to answer a request.
  static constexpr int kConnectTimeoutMs = 5000;
  // Host ports for host-initiated connections count up from here.
  static constexpr uint32_t kFirstHostPort = 1u << 30;
  // Bounds on what waits for guest rx buffers: host data per connection and
  // in all, and control packets (a guest that posts no rx buffers cannot make
  // the device grow without limit).
  static constexpr size_t kMaxQueuedPerConn = 256 * 1024;
  static constexpr size_t kMaxQueuedTotal = 8 * 1024 * 1024;
  static constexpr size_t kMaxQueuedControl = 1024;
  // Packets of any kind waiting for the guest: the byte limits count payload only, and a guest
  // granting credit a byte at a time over many connections made one ~100-byte packet per byte.
  static constexpr size_t kMaxQueuedPackets = 8192;
  // Tx chains handled per loop pass before host I/O gets a turn.
  static constexpr int kMaxTxPerPass = 4 * kQueueSize;

  struct Stats {
    uint64_t tx_packets;       // packets taken from the tx queue
    uint64_t rx_packets;       // packets given to the guest
    uint64_t bad_packets;      // malformed guest packets (dropped or reset)
    uint64_t resets_sent;      // RST packets sent to the guest
    uint64_t dropped_control;  // control packets dropped because the guest posted no rx buffers
    uint64_t connections;      // open connections now
    uint64_t parked;           // 1 while the loop is parked (RequestPark), else 0
    uint64_t parks;            // times it parked
    uint64_t park_refusals;    // parks asked for and refused (it had work waiting), with no pass
  };

  // The part of the device state that a snapshot keeps. Connections are not
  // part of it: a restored device starts with none and tells the guest with a
  // transport reset event.
  struct State {
    uint64_t guest_cid = 0;
    bool active = false;
    uint64_t driver_features = 0;
    Virtqueue::State queues[3];
    uint32_t next_host_port = 0;
  };

  // Listens on `uds_path` (a stale socket there is replaced). Throws
  // std::system_error (code = errno) when the socket cannot be set up, and
  // std::invalid_argument for a CID below 3 or a path too long for a Unix
  // socket (with room for the "_<port>" suffix).
  VirtioVsock(uint64_t guest_cid, std::string uds_path);
  ~VirtioVsock() override;
  VirtioVsock(const VirtioVsock&) = delete;
  VirtioVsock& operator=(const VirtioVsock&) = delete;

  uint32_t DeviceId() const override { return kVirtioIdVsock; }
  uint64_t DeviceFeatures() const override { return kVirtioFVersion1 | kVirtioFIndirectDesc; }
  uint16_t NumQueues() const override { return 3; }
  uint16_t MaxQueueSize(uint16_t queue) const override { return queue < 3 ? kQueueSize : 0; }
  void ReadConfig(uint32_t offset, uint8_t* data, uint32_t len) override;
  void WriteConfig(uint32_t offset, const uint8_t* data, uint32_t len) override {}
  void Activate(const GuestMemory& mem, const std::vector<QueueConfig>& queues, uint64_t driver_features,
                NotifyGuest notify_guest) override;
  void QueueNotify(uint16_t queue) override;
  void Reset() override;

  // Drops every connection and sends the guest VIRTIO_VSOCK_EVENT_TRANSPORT_RESET
  // (as soon as it has an event buffer). Any thread.
  void TransportReset();
  // Waits until the event loop has completed one full pass that began after
  // this call (all kicks and host I/O before the call handled). False on
  // timeout. True at once when the device is not active.
  bool Sync(int timeout_ms);
  Stats stats() const;
  const std::string& uds_path() const { return uds_path_; }
  uint64_t guest_cid() const { return guest_cid_; }

  // Snapshot support. Pause stops the event loop (so guest memory and the
  // ring positions hold still; pause the vCPUs first) and keeps everything
  // else; SaveState (paused) gives the ring positions; Resume restarts the
  // loop. RestoreState activates the device from a saved state over (a copy
  // of) the guest memory, with no connections, and sends the guest a
  // transport reset so it forgets its connections too (and re-reads the
  // config: this device's own CID counts, state.guest_cid is informational).
  // A saved state is checked like a driver's layout: a bad one fails the device.
  void Pause();
  void Resume();
  // Called on the event loop for every host event (a connection, bytes, a
  // close) before it is handled: the VMM wakes a dozing guest (vm.h Doze).
  // Set before the device is activated.
  void OnHostInput(std::function<void()> fn) { on_host_input_ = std::move(fn); }
  // Called on the event loop at the start of each of its passes, before it
  // reads or writes guest RAM (the VMM unpacks packed pages: vm.h Pack).
  // Set before the device is activated.
  void BeforePass(std::function<void()> fn) { before_pass_ = std::move(fn); }
  // Holds the event loop between two passes for as long as the lock is held
  // (it reads and writes guest RAM only in a pass). Not with Pause or Reset
  // in the same thread: those wait for the loop.
  std::unique_lock<std::mutex> HoldLoop() { return std::unique_lock<std::mutex>(pass_mu_); }
  // Asks the event loop to park at its next wake if it has nothing to do:
  // its thread ends and the park watch holds its epoll fd, which reads ready
  // at a host connection, bytes, a close or a kick; the watch then starts
  // the loop again, which handles what woke it as usual. For a VM that is
  // shelved (vm.h Shelve): no guest runs to kick it, so it may be a while.
  // A Sync, transport reset or guest kick gets its pass first. Refused (a
  // deadline, a host hang-up with work left, packets waiting for the guest;
  // a device not owned by a std::shared_ptr, since the watch holds a weak
  // one), the loop waits as before, with no pass for the request. Any thread.
  void RequestPark();
  // The VM woke before the loop looked (Vm::Unpack): a park asked for is dropped. Any thread.
  void CancelPark() { park_requested_ = false; }
  State SaveState() const;
  void RestoreState(const GuestMemory& mem, const State& state, NotifyGuest notify_guest);

 private:
  struct Conn;
  struct Packet {
    VsockHeader hdr;
    std::string data;     // payload (RW only)
    size_t off = 0;       // bytes of `data` already delivered
    uint64_t conn_id = 0; // RW: the connection (its credit fields are filled in at delivery)
  };

  void ClearRuntime();
  // kOwed: a pass is due first (a kick, sync or transport reset); kBusy: a control call holds it.
  enum class ParkResult { kParked, kOwed, kBusy, kNotIdle };
  ParkResult TryPark();        // on the loop thread, kick_fd_ drained
  void Unpark(uint64_t token);  // on the park watch's thread
  uint64_t WatchWhileParked();  // park_watch::Watch of epoll_fd_ (0: not watched)
  void FreeReadBuffer();
  // False when no thread could be made (it fails the device too, if fail_device).
  bool StartLoop(bool fail_device = true);
  void WakeLoop();  // one write to kick_fd_: the loop's epoll_wait returns
  void StopLoop();
  void Loop();
  void Kick();
  void Pass();
  void ProcessTx();
  void HandlePacket(const VsockHeader& h, const DescriptorChain& chain);
  void DeliverRx();
  void DeliverEvents();
  void AcceptAll();
  void HandleConnEvent(uint64_t id, uint32_t events);
  void ReadConnectLine(Conn* c);
  void ReadFromHost(Conn* c);
  void FlushToHost(Conn* c);
  void GuestConnect(const VsockHeader& h);
  // False when dropped (the guest left kMaxQueuedControl waiting).
  bool QueueControl(uint16_t op, uint32_t flags, const Conn* c);
  void QueueRst(uint32_t host_port, uint32_t guest_port);
  void ResetConn(Conn* c);  // RST to the guest, then close
  void CloseConn(Conn* c);
  void CloseAll();
  void UpdateInterest(Conn* c);
  void MaybeCreditUpdate(Conn* c);
  void CheckDeadlines();
  int NextTimeoutMs() const;
  Conn* FindConn(uint32_t host_port, uint32_t guest_port);
  Conn* FindId(uint64_t id);
  uint32_t PeerCredit(const Conn* c) const;
  // Bytes of host data the shared rx queue still takes (0 at either of its bounds).
  size_t RxRoomAll() const;
  void FailDevice(const std::string& message);

  const uint64_t guest_cid_;
  const std::string uds_path_;
  uint64_t uds_dev_ = 0, uds_ino_ = 0;  // the socket file we created (unlinked only if still ours)
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int kick_fd_ = -1;

  mutable std::mutex control_mu_;  // serialises Activate / Reset / Pause / Resume / RestoreState
  bool active_ = false;            // activated and not reset (the loop may be paused)
  bool paused_ = false;             // held still by the VMM (Pause) until Resume, whatever the guest does
  VmmThread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> kick_pending_{false};
  std::atomic<bool> transport_reset_pending_{false};
  // Parked (RequestPark): its thread has ended (joined by the next StartLoop or StopLoop) and
  // the park watch holds epoll_fd_ under park_token_. Changed under control_mu_, but for the
  // clear by the loop Unpark starts (Loop: before its first pass; it cannot park again before
  // Unpark lets control_mu_ go).
  std::atomic<bool> parked_{false};
  std::atomic<bool> park_requested_{false};
  uint64_t park_token_ = 0;

  // Sync(): requests and completions counted under sync_mu_.
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  uint64_t sync_requested_ = 0;
  uint64_t sync_done_ = 0;

  // Owned by the loop thread while it runs (by the caller of
  // Activate/Reset otherwise).
  GuestMemory mem_;
  uint64_t driver_features_ = 0;
  Virtqueue queues_[3];
  NotifyGuest notify_;
  std::function<void()> on_host_input_;
  std::function<void()> before_pass_;
  std::mutex pass_mu_;  // held by the loop for each pass (HoldLoop)
  bool event_reset_owed_ = false;  // a transport reset event still to deliver
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns_;  // by id
  std::unordered_map<uint64_t, Conn*> by_ports_;               // (host_port << 32 | guest_port)
  uint64_t next_conn_id_ = 16;  // ids below 16 are the listener and the kick eventfd
  uint32_t next_host_port_ = kFirstHostPort;
  std::deque<Packet> rx_pending_;
  size_t rx_pending_control_ = 0;
  size_t rx_pending_bytes_ = 0;
  DescriptorChain chain_;
  // Host reads land here first: kMaxPacketPayload bytes mapped at the first read and unmapped
  // when the loop parks (FreeReadBuffer).
  char* read_buf_ = nullptr;

  struct Counters {
    std::atomic<uint64_t> tx_packets{0}, rx_packets{0}, bad_packets{0}, resets_sent{0}, dropped_control{0},
        connections{0}, parks{0}, park_refusals{0};
  } counters_;
};

}  // namespace forkling::vmm
