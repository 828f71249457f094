#include "vmm/legacy_devices.h"

#include <ctime>

namespace forkling::vmm {

// ---- 8250 UART -------------------------------------------------------------

uint8_t Uart8250::Iir() const {
  if ((ier_ & kIerRdi) && !rx_.empty()) return kIirRdi | kIirFifo;
  if ((ier_ & kIerThri) && thre_pending_) return kIirThri | kIirFifo;
  return kIirNone | kIirFifo;  // FIFO bits: Linux detects a 16550A and sends 16 bytes per interrupt
}

void Uart8250::MaybeInterrupt(bool newly) {
  // Edge semantics (ISA IRQs are edge-triggered): pulse when a new cause appears.
  if (newly && (Iir() & kIirNone) == 0 && irq_) irq_();
}

uint8_t Uart8250::Read(uint8_t offset) {
  switch (offset & 7) {
    case kData:
      if (lcr_ & kLcrDlab) return dll_;
      if (rx_.empty()) return 0;
      {
        uint8_t b = rx_.front();
        rx_.pop_front();
        return b;
      }
    case kIer:
      return (lcr_ & kLcrDlab) ? dlm_ : ier_;
    case kIir: {
      uint8_t v = Iir();
      // Reading IIR acknowledges a THR-empty interrupt (8250 data sheet).
      if ((v & 0x0f) == kIirThri) thre_pending_ = false;
      return v;
    }
    case kLcr:
      return lcr_;
    case kMcr:
      return mcr_;
    case kLsr:
      // Transmission is instantaneous: THR and the shift register are always empty.
      return kLsrThre | kLsrTemt | (rx_.empty() ? 0 : kLsrDr);
    case kMsr:
      if (mcr_ & kMcrLoop) {
        // Loopback: DTR->DSR, RTS->CTS, OUT1->RI, OUT2->DCD (Linux's probe checks this).
        return uint8_t(((mcr_ & 0x01) << 5) | ((mcr_ & 0x02) << 3) | ((mcr_ & 0x0c) << 4));
      }
      return 0xb0;  // DCD | DSR | CTS: a connected terminal
    default:
      return scr_;
  }
}

void Uart8250::Write(uint8_t offset, uint8_t value) {
  switch (offset & 7) {
    case kData:
      if (lcr_ & kLcrDlab) {
        dll_ = value;
        return;
      }
      if (mcr_ & kMcrLoop) {
        if (rx_.size() < kInputMax) rx_.push_back(value);
        MaybeInterrupt(ier_ & kIerRdi);
      } else if (out_) {
        out_(value);
      }
      // The byte is gone at once: THR is empty again, which is a new interrupt cause.
      thre_pending_ = true;
      MaybeInterrupt(ier_ & kIerThri);
      return;
    case kIer:
      if (lcr_ & kLcrDlab) {
        dlm_ = value;
        return;
      }
      {
        bool thri_on = (value & kIerThri) && !(ier_ & kIerThri);
        bool rdi_on = (value & kIerRdi) && !(ier_ & kIerRdi);
        ier_ = value & 0x0f;
        // Enabling THRI while THR is empty raises the interrupt at once (the
        // kernel's tty layer relies on it to start transmitting).
        if (thri_on) thre_pending_ = true;
        MaybeInterrupt(thri_on || (rdi_on && !rx_.empty()));
      }
      return;
    case kIir:  // FCR: FIFOs are always on; a receive-FIFO reset clears input
      if (value & 0x02) rx_.clear();
      return;
    case kLcr:
      lcr_ = value;
      return;
    case kMcr:
      mcr_ = value & 0x1f;
      return;
    case kLsr:
    case kMsr:
      return;  // read-only (factory test writes ignored)
    default:
      scr_ = value;
      return;
  }
}

void Uart8250::Input(const uint8_t* data, size_t len) {
  bool was_empty = rx_.empty();
  for (size_t i = 0; i < len && rx_.size() < kInputMax; i++) rx_.push_back(data[i]);
  MaybeInterrupt(was_empty && !rx_.empty() && (ier_ & kIerRdi));
}

// ---- i8042 -----------------------------------------------------------------

namespace {
constexpr uint8_t kStatusObf = 0x01, kStatusSys = 0x04, kStatusCmd = 0x08;
}

uint8_t I8042::Read(uint16_t port) {
  if (port == 0x64) return uint8_t((out_.empty() ? 0 : kStatusObf) | kStatusSys | (pending_cmd_ ? kStatusCmd : 0));
  if (out_.empty()) return 0;
  uint8_t b = out_.front();
  out_.pop_front();
  return b;
}

void I8042::Write(uint16_t port, uint8_t value) {
  if (port == 0x64) {
    pending_cmd_ = 0;
    switch (value) {
      case 0x20: out_.push_back(ctr_); break;   // read command byte
      case 0x60: pending_cmd_ = value; break;   // write command byte: next data byte
      case 0xd0: out_.push_back(outp_); break;  // read output port
      case 0xd1: pending_cmd_ = value; break;   // write output port
      case 0xaa: out_.push_back(0x55); break;   // controller self test: passed
      case 0xab: out_.push_back(0x00); break;   // keyboard interface test: ok
      case 0xfe:                                // pulse the reset line
        if (reset_) reset_();
        break;
      default: break;  // enable/disable ports etc.: nothing to model
    }
    if (out_.size() > 16) out_.pop_front();
    return;
  }
  // Data port.
  if (pending_cmd_ == 0x60) {
    ctr_ = value;
  } else if (pending_cmd_ == 0xd1) {
    outp_ = value;
    if (!(value & 0x01) && reset_) reset_();  // bit 0 low = CPU reset
  }
  // Bytes for the keyboard itself get no answer: there is no keyboard (the
  // kernel runs with i8042.dumbkbd and never waits for one).
  pending_cmd_ = 0;
}

// ---- CMOS RTC --------------------------------------------------------------

namespace {
uint8_t Bcd(int v) { return uint8_t(((v / 10) << 4) | (v % 10)); }
}  // namespace

uint8_t CmosRtc::Read(uint16_t port) {
  if (port == 0x70) return index_;
  uint8_t i = index_ & 0x7f;
  time_t now = time(nullptr);
  struct tm tm;
  gmtime_r(&now, &tm);
  switch (i) {
    case 0x00: return Bcd(tm.tm_sec);
    case 0x02: return Bcd(tm.tm_min);
    case 0x04: return Bcd(tm.tm_hour);
    case 0x06: return Bcd(tm.tm_wday + 1);
    case 0x07: return Bcd(tm.tm_mday);
    case 0x08: return Bcd(tm.tm_mon + 1);
    case 0x09: return Bcd(tm.tm_year % 100);
    case 0x32: return Bcd(19 + tm.tm_year / 100);
    case 0x0a: return 0x26;  // 32.768 kHz, 1024 Hz; update-in-progress never set
    case 0x0b: return 0x02;  // 24-hour, BCD, no interrupts
    case 0x0c: return 0x00;
    case 0x0d: return 0x80;  // battery good
    default: return ram_[i];
  }
}

void CmosRtc::Write(uint16_t port, uint8_t value) {
  if (port == 0x70) {
    index_ = value & 0x7f;  // bit 7 is the NMI mask
    return;
  }
  if (index_ >= 0x0e) ram_[index_] = value;  // time writes (hwclock) are ignored: the host owns the clock
}

}  // namespace forkling::vmm
