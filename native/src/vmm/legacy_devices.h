// The legacy PC devices the stock Linux kernel looks for: an 8250/16550A UART
// (the console), an i8042 keyboard controller (only so that `reboot=k` can
// reset the machine), and a CMOS RTC (so the rtc driver and the wall clock
// read sane values). Each is a plain state machine over port offsets, driven
// by the VM's I/O dispatch (under its lock) and by tests without KVM.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace forkling::vmm {

// A FIFO of bytes that holds no memory while empty: std::deque allocates
// ~0.5 KiB as it is made, and every VM has two of these, empty nearly always.
class ByteFifo {
 public:
  bool empty() const { return head_ == buf_.size(); }
  size_t size() const { return buf_.size() - head_; }
  uint8_t front() const { return buf_[head_]; }
  void push_back(uint8_t b) {
    if (head_ > 0 && head_ >= buf_.size() / 2) {  // (the bytes read go, at most once per size doubling)
      buf_.erase(buf_.begin(), buf_.begin() + std::ptrdiff_t(head_));
      head_ = 0;
    }
    buf_.push_back(b);
  }
  void pop_front() {
    if (++head_ == buf_.size()) clear();
  }
  void clear() {
    std::vector<uint8_t>().swap(buf_);
    head_ = 0;
  }

 private:
  std::vector<uint8_t> buf_;
  size_t head_ = 0;
};

class Uart8250 {
 public:
  using IrqPulse = std::function<void()>;
  using Output = std::function<void(uint8_t)>;

  Uart8250(IrqPulse irq, Output out) : irq_(std::move(irq)), out_(std::move(out)) {}

  // offset 0..7 from the base port.
  uint8_t Read(uint8_t offset);
  void Write(uint8_t offset, uint8_t value);
  // Bytes for the guest to read (host input); raises the receive interrupt.
  void Input(const uint8_t* data, size_t len);

  // Snapshot: the registers (pending host input is not kept).
  struct State {
    uint8_t ier, lcr, mcr, scr, dll, dlm;
    uint8_t thre_pending;
  };
  State SaveState() const { return State{ier_, lcr_, mcr_, scr_, dll_, dlm_, uint8_t(thre_pending_)}; }
  void RestoreState(const State& s) {
    ier_ = s.ier, lcr_ = s.lcr, mcr_ = s.mcr, scr_ = s.scr, dll_ = s.dll, dlm_ = s.dlm;
    thre_pending_ = s.thre_pending != 0;
    rx_.clear();
  }

  // Register numbers and bits (the 8250 data sheet names).
  enum : uint8_t { kData = 0, kIer = 1, kIir = 2, kLcr = 3, kMcr = 4, kLsr = 5, kMsr = 6, kScr = 7 };
  static constexpr uint8_t kIerRdi = 0x01, kIerThri = 0x02;
  static constexpr uint8_t kIirNone = 0x01, kIirThri = 0x02, kIirRdi = 0x04, kIirFifo = 0xc0;
  static constexpr uint8_t kLcrDlab = 0x80;
  static constexpr uint8_t kMcrLoop = 0x10;
  static constexpr uint8_t kLsrDr = 0x01, kLsrThre = 0x20, kLsrTemt = 0x40;
  static constexpr size_t kInputMax = 4096;

 private:
  uint8_t Iir() const;
  void MaybeInterrupt(bool newly);

  IrqPulse irq_;
  Output out_;
  uint8_t ier_ = 0, lcr_ = 0, mcr_ = 0x08 /*OUT2*/, scr_ = 0, dll_ = 0x0c, dlm_ = 0;
  bool thre_pending_ = false;  // THR-empty interrupt owed until IIR is read or THR written
  ByteFifo rx_;
};

class I8042 {
 public:
  using Reset = std::function<void()>;
  explicit I8042(Reset reset) : reset_(std::move(reset)) {}
  // port 0x60 (data) or 0x64 (status/command).
  uint8_t Read(uint16_t port);
  void Write(uint16_t port, uint8_t value);

  // Snapshot: the controller registers (queued output bytes are not kept).
  struct State {
    uint8_t ctr, outp, pending_cmd;
  };
  State SaveState() const { return State{ctr_, outp_, pending_cmd_}; }
  void RestoreState(const State& s) {
    ctr_ = s.ctr, outp_ = s.outp, pending_cmd_ = s.pending_cmd;
    out_.clear();
  }

 private:
  Reset reset_;
  uint8_t ctr_ = 0x45;  // kbd interrupt, system flag, translate (what firmware leaves)
  uint8_t outp_ = 0x01;
  uint8_t pending_cmd_ = 0;
  ByteFifo out_;
};

class CmosRtc {
 public:
  // port 0x70 (index) or 0x71 (data). Time registers read the host's UTC clock.
  uint8_t Read(uint16_t port);
  void Write(uint16_t port, uint8_t value);

  // Snapshot: the index register and CMOS RAM (time registers read the host clock anyway).
  struct State {
    uint8_t index;
    uint8_t ram[128];
  };
  State SaveState() const {
    State s;
    s.index = index_;
    std::memcpy(s.ram, ram_, sizeof ram_);
    return s;
  }
  void RestoreState(const State& s) {
    index_ = s.index & 0x7f;
    std::memcpy(ram_, s.ram, sizeof ram_);
  }

 private:
  uint8_t index_ = 0;
  uint8_t ram_[128] = {};
};

}  // namespace forkling::vmm
