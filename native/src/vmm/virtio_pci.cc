#include "vmm/virtio_pci.h"

#include <cstring>

namespace forkling::vmm {
namespace {

constexpr uint8_t kCapVendor = 0x09, kCapMsix = 0x11;
constexpr uint8_t kCfgCommon = 1, kCfgNotify = 2, kCfgIsr = 3, kCfgDevice = 4;

std::vector<uint8_t> VirtioCap(uint8_t type, uint32_t offset, uint32_t length, bool notify) {
  std::vector<uint8_t> c(notify ? 20 : 16, 0);
  c[0] = kCapVendor;
  c[2] = uint8_t(c.size());
  c[3] = type;
  c[4] = 0;  // BAR0
  std::memcpy(&c[8], &offset, 4);
  std::memcpy(&c[12], &length, 4);
  if (notify) {
    uint32_t mult = uint32_t(VirtioPciDevice::kNotifyMultiplier);
    std::memcpy(&c[16], &mult, 4);
  }
  return c;
}

template <class T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

bool PowerOfTwo(uint32_t v) { return v && !(v & (v - 1)); }

}  // namespace

VirtioPciDevice::VirtioPciDevice(std::shared_ptr<VirtioDevice> dev, const GuestMemory& mem, uint64_t bar_addr,
                                 SignalMsi msi, DeviceError on_error)
    : dev_(std::move(dev)), mem_(mem), msi_(std::move(msi)), on_error_(std::move(on_error)) {
  nq_ = dev_->NumQueues();
  nvec_ = uint16_t(nq_ + 1);  // one per queue + config
  queues_ = std::make_unique<Queue[]>(nq_);
  for (uint16_t i = 0; i < nq_; i++) queues_[i].cfg.size = dev_->MaxQueueSize(i);
  table_.assign(size_t(nvec_) * 4, 0);
  for (uint16_t i = 0; i < nvec_; i++) table_[i * 4 + 3] = 1;  // masked at reset (PCI spec)
  pending_.assign(nvec_, false);

  uint16_t id = uint16_t(dev_->DeviceId());
  // Modern-only virtio device: 0x1040 + type, revision 1.
  InitHeader(0x1af4, uint16_t(0x1040 + id), 0xff0000, 1, 0x1af4, uint16_t(0x40 + id));
  AddMemBar64(0, kBarSize, bar_addr);

  std::vector<uint8_t> msix(12, 0), msix_w(12, 0);
  msix[0] = kCapMsix;
  uint16_t ctrl = uint16_t(nvec_ - 1);
  std::memcpy(&msix[2], &ctrl, 2);
  uint32_t table = uint32_t(kMsixTableOff), pba = uint32_t(kMsixPbaOff);  // BIR 0
  std::memcpy(&msix[4], &table, 4);
  std::memcpy(&msix[8], &pba, 4);
  msix_w[3] = 0xc0;  // MSI-X enable, function mask
  msix_cap_ = AddCapability(msix, msix_w);
  AddCapability(VirtioCap(kCfgCommon, uint32_t(kCommonOff), uint32_t(kCommonLen), false), {});
  AddCapability(VirtioCap(kCfgNotify, uint32_t(kNotifyOff), uint32_t(nq_ * kNotifyMultiplier), true), {});
  AddCapability(VirtioCap(kCfgIsr, uint32_t(kIsrOff), uint32_t(kIsrLen), false), {});
  AddCapability(VirtioCap(kCfgDevice, uint32_t(kDeviceOff), uint32_t(kDeviceLen), false), {});

  dev_->set_failure_callback([this](const std::string& message) {
    needs_reset_ = true;
    NotifyConfig();
    if (on_error_) on_error_(message);
  });
}

VirtioPciDevice::~VirtioPciDevice() {
  dev_->Reset();
  dev_->set_failure_callback(nullptr);
}

void VirtioPciDevice::Reset() {
  dev_->Reset();
  status_ = 0;
  active_ = false;
  device_feature_select_ = driver_feature_select_ = 0;
  driver_features_[0] = driver_features_[1] = 0;
  queue_select_ = 0;
  for (uint16_t i = 0; i < nq_; i++) {
    queues_[i].cfg = QueueConfig{};
    queues_[i].cfg.size = dev_->MaxQueueSize(i);
    queues_[i].vector = kNoVector;
  }
  config_vector_ = kNoVector;
  isr_ = 0;
  needs_reset_ = false;
}

// ---- BAR0 ------------------------------------------------------------------

void VirtioPciDevice::BarRead(int bar, uint64_t off, uint8_t* data, uint32_t len) {
  std::memset(data, 0, len);
  if (bar != 0) return;
  if (off >= kCommonOff && off < kCommonOff + kCommonLen) {
    CommonRead(off - kCommonOff, data, len);
  } else if (off >= kIsrOff && off < kIsrOff + kIsrLen) {
    // Reading the ISR acknowledges it.
    if (off == kIsrOff) data[0] = isr_.exchange(0);
  } else if (off >= kDeviceOff && off < kDeviceOff + kDeviceLen) {
    if (len <= kDeviceOff + kDeviceLen - off) dev_->ReadConfig(uint32_t(off - kDeviceOff), data, len);
  } else if (off >= kMsixTableOff && off < kMsixTableOff + uint64_t(nvec_) * 16) {
    MsixTableRead(off - kMsixTableOff, data, len);
  } else if (off >= kMsixPbaOff && off < kMsixPbaOff + 8) {
    std::lock_guard<std::mutex> l(msix_mu_);
    uint64_t bits = 0;
    for (uint16_t i = 0; i < nvec_ && i < 64; i++) bits |= uint64_t(pending_[i]) << i;
    uint64_t o = off - kMsixPbaOff;
    for (uint32_t i = 0; i < len && o + i < 8; i++) data[i] = uint8_t(bits >> (8 * (o + i)));
  }
}

void VirtioPciDevice::BarWrite(int bar, uint64_t off, const uint8_t* data, uint32_t len) {
  if (bar != 0) return;
  if (off >= kCommonOff && off < kCommonOff + kCommonLen) {
    CommonWrite(off - kCommonOff, data, len);
  } else if (off >= kNotifyOff && off < kNotifyOff + uint64_t(nq_) * kNotifyMultiplier) {
    uint16_t q = uint16_t((off - kNotifyOff) / kNotifyMultiplier);
    if (active_ && !needs_reset_ && queues_[q].cfg.ready) dev_->QueueNotify(q);
  } else if (off >= kDeviceOff && off < kDeviceOff + kDeviceLen) {
    if (len <= kDeviceOff + kDeviceLen - off) dev_->WriteConfig(uint32_t(off - kDeviceOff), data, len);
  } else if (off >= kMsixTableOff && off < kMsixTableOff + uint64_t(nvec_) * 16) {
    MsixTableWrite(off - kMsixTableOff, data, len);
  }
}

// ---- common configuration structure -----------------------------------------

void VirtioPciDevice::SnapshotCommon(uint8_t* b) {
  std::memset(b, 0, kCommonLen);
  uint64_t feats = dev_->DeviceFeatures() | kVirtioFVersion1;
  uint32_t df = device_feature_select_ == 0 ? uint32_t(feats) : device_feature_select_ == 1 ? uint32_t(feats >> 32) : 0;
  uint32_t drf = driver_feature_select_ < 2 ? driver_features_[driver_feature_select_] : 0;
  uint16_t cv = config_vector_;
  std::memcpy(b + 0x00, &device_feature_select_, 4);
  std::memcpy(b + 0x04, &df, 4);
  std::memcpy(b + 0x08, &driver_feature_select_, 4);
  std::memcpy(b + 0x0c, &drf, 4);
  std::memcpy(b + 0x10, &cv, 2);
  std::memcpy(b + 0x12, &nq_, 2);
  b[0x14] = status();
  b[0x15] = 0;  // config_generation: device config never changes under the driver
  std::memcpy(b + 0x16, &queue_select_, 2);
  if (queue_select_ < nq_) {
    const Queue& q = queues_[queue_select_];
    uint16_t size = q.cfg.size, vec = q.vector, en = q.cfg.ready ? 1 : 0, noff = queue_select_;
    std::memcpy(b + 0x18, &size, 2);
    std::memcpy(b + 0x1a, &vec, 2);
    std::memcpy(b + 0x1c, &en, 2);
    std::memcpy(b + 0x1e, &noff, 2);
    std::memcpy(b + 0x20, &q.cfg.desc, 8);
    std::memcpy(b + 0x28, &q.cfg.driver, 8);
    std::memcpy(b + 0x30, &q.cfg.device, 8);
  }
}

void VirtioPciDevice::CommonRead(uint64_t off, uint8_t* data, uint32_t len) {
  uint8_t b[kCommonLen];
  SnapshotCommon(b);
  if (len > kCommonLen - off) len = uint32_t(kCommonLen - off);
  std::memcpy(data, b + off, len);
}

void VirtioPciDevice::CommonWrite(uint64_t off, const uint8_t* data, uint32_t len) {
  if (len > kCommonLen - off) return;
  uint8_t b[kCommonLen];
  SnapshotCommon(b);
  std::memcpy(b + off, data, len);
  auto touched = [&](uint64_t fo, uint64_t fl) { return off < fo + fl && fo < off + len; };
  auto vec = [&](uint16_t v) { return v < nvec_ ? v : kNoVector; };  // reads back NO_VECTOR when refused

  if (touched(0x00, 4)) device_feature_select_ = Load<uint32_t>(b + 0x00);
  if (touched(0x08, 4)) driver_feature_select_ = Load<uint32_t>(b + 0x08);
  if (touched(0x0c, 4) && driver_feature_select_ < 2 && !(status_ & kFeaturesOk))
    driver_features_[driver_feature_select_] = Load<uint32_t>(b + 0x0c);
  if (touched(0x10, 2)) config_vector_ = vec(Load<uint16_t>(b + 0x10));
  if (touched(0x16, 2)) queue_select_ = Load<uint16_t>(b + 0x16);
  if (queue_select_ < nq_) {
    Queue& q = queues_[queue_select_];
    if (touched(0x1a, 2)) q.vector = vec(Load<uint16_t>(b + 0x1a));
    // The queue layout is frozen once the device runs.
    if (!active_) {
      if (touched(0x18, 2)) q.cfg.size = Load<uint16_t>(b + 0x18);
      if (touched(0x1c, 2)) q.cfg.ready = Load<uint16_t>(b + 0x1c) == 1;
      if (touched(0x20, 8)) q.cfg.desc = Load<uint64_t>(b + 0x20);
      if (touched(0x28, 8)) q.cfg.driver = Load<uint64_t>(b + 0x28);
      if (touched(0x30, 8)) q.cfg.device = Load<uint64_t>(b + 0x30);
    }
  }
  if (touched(0x14, 1)) SetStatus(b[0x14]);
}

void VirtioPciDevice::SetStatus(uint8_t v) {
  if (v == 0) {
    Reset();
    return;
  }
  v &= uint8_t(~kNeedsReset);
  if ((v & kFeaturesOk) && !(status_ & kFeaturesOk)) {
    uint64_t offered = dev_->DeviceFeatures() | kVirtioFVersion1;
    uint64_t accepted = (uint64_t(driver_features_[1]) << 32) | driver_features_[0];
    // Refuse (leave FEATURES_OK clear, which the driver reads back) a subset
    // violation or a legacy driver.
    if ((accepted & ~offered) || !(accepted & kVirtioFVersion1)) v &= uint8_t(~kFeaturesOk);
  }
  status_ = v;
  if ((v & kDriverOk) && (v & kFeaturesOk) && !active_ && !needs_reset_) Activate();
}

void VirtioPciDevice::Activate() {
  std::vector<QueueConfig> qs(nq_);
  for (uint16_t i = 0; i < nq_; i++) {
    const QueueConfig& c = queues_[i].cfg;
    qs[i] = c;
    if (!c.ready) continue;
    uint64_t n = c.size;
    bool ok = PowerOfTwo(c.size) && c.size <= dev_->MaxQueueSize(i) && !(c.desc & 15) && !(c.driver & 1) &&
              !(c.device & 3) && mem_.Contains(c.desc, 16 * n) && mem_.Contains(c.driver, 6 + 2 * n) &&
              mem_.Contains(c.device, 6 + 8 * n);
    if (!ok) {
      needs_reset_ = true;
      NotifyConfig();
      if (on_error_) on_error_("virtio queue " + std::to_string(i) + " has an invalid size or layout");
      return;
    }
  }
  uint64_t accepted = (uint64_t(driver_features_[1]) << 32) | driver_features_[0];
  active_ = true;
  dev_->Activate(mem_, qs, accepted, [this](uint16_t q) { NotifyQueue(q); });
  // Buffers the driver made available (and kicked) before DRIVER_OK.
  for (uint16_t i = 0; i < nq_; i++)
    if (qs[i].ready && !needs_reset_) dev_->QueueNotify(i);
}

// ---- interrupts ------------------------------------------------------------

void VirtioPciDevice::NotifyQueue(uint16_t q) {
  if (q >= nq_) return;
  isr_.fetch_or(1);
  SignalVector(queues_[q].vector);
}

void VirtioPciDevice::NotifyConfig() {
  isr_.fetch_or(2);
  SignalVector(config_vector_);
}

void VirtioPciDevice::SignalVector(uint16_t v) {
  if (v >= nvec_) return;  // NO_VECTOR: this transport has no INTx
  uint64_t addr = 0;
  uint32_t data = 0;
  {
    std::lock_guard<std::mutex> l(msix_mu_);
    if (!msix_enabled_) return;
    if (msix_masked_ || (table_[v * 4 + 3] & 1)) {
      pending_[v] = true;
      return;
    }
    addr = (uint64_t(table_[v * 4 + 1]) << 32) | table_[v * 4];
    data = table_[v * 4 + 2];
  }
  interrupts_++;
  if (msi_) msi_(addr, data);
}

void VirtioPciDevice::DeliverPendingLocked() {
  if (!msix_enabled_ || msix_masked_) return;
  for (uint16_t v = 0; v < nvec_; v++) {
    if (pending_[v] && !(table_[v * 4 + 3] & 1)) {
      pending_[v] = false;
      interrupts_++;
      if (msi_) msi_((uint64_t(table_[v * 4 + 1]) << 32) | table_[v * 4], table_[v * 4 + 2]);
    }
  }
}

void VirtioPciDevice::MsixTableRead(uint64_t off, uint8_t* data, uint32_t len) {
  std::lock_guard<std::mutex> l(msix_mu_);
  uint64_t end = uint64_t(nvec_) * 16;
  for (uint32_t i = 0; i < len && off + i < end; i++) {
    uint64_t o = off + i;
    data[i] = uint8_t(table_[o / 4] >> (8 * (o % 4)));
  }
}

void VirtioPciDevice::MsixTableWrite(uint64_t off, const uint8_t* data, uint32_t len) {
  std::lock_guard<std::mutex> l(msix_mu_);
  uint64_t end = uint64_t(nvec_) * 16;
  for (uint32_t i = 0; i < len && off + i < end; i++) {
    uint64_t o = off + i;
    uint32_t& w = table_[o / 4];
    uint32_t shift = 8 * (o % 4);
    uint32_t nv = (w & ~(0xffu << shift)) | (uint32_t(data[i]) << shift);
    if (o % 16 >= 12) nv &= 1;  // vector control: only the mask bit exists
    w = nv;
  }
  DeliverPendingLocked();  // an entry may just have been unmasked
}

VirtioPciDevice::TransportState VirtioPciDevice::SaveTransport() {
  TransportState s;
  s.device_feature_select = device_feature_select_;
  s.driver_feature_select = driver_feature_select_;
  s.driver_features[0] = driver_features_[0];
  s.driver_features[1] = driver_features_[1];
  s.queue_select = queue_select_;
  s.status = status_;
  s.active = active_;
  s.needs_reset = needs_reset_;
  s.config_vector = config_vector_;
  s.isr = isr_;
  for (uint16_t i = 0; i < nq_; i++) {
    s.queues.push_back(queues_[i].cfg);
    s.vectors.push_back(queues_[i].vector);
  }
  std::lock_guard<std::mutex> l(msix_mu_);
  s.msix_table = table_;
  for (bool b : pending_) s.msix_pending.push_back(b);
  return s;
}

std::string VirtioPciDevice::RestoreTransport(
    const TransportState& s, const std::function<void(const GuestMemory&, VirtioDevice::NotifyGuest)>& restore_device) {
  if (s.queues.size() != nq_ || s.vectors.size() != nq_ || s.msix_table.size() != table_.size() ||
      s.msix_pending.size() != pending_.size())
    return "saved virtio transport has a different number of queues or vectors";
  device_feature_select_ = s.device_feature_select;
  driver_feature_select_ = s.driver_feature_select;
  driver_features_[0] = s.driver_features[0];
  driver_features_[1] = s.driver_features[1];
  queue_select_ = s.queue_select;
  status_ = s.status;
  needs_reset_ = s.needs_reset;
  config_vector_ = s.config_vector < nvec_ ? s.config_vector : kNoVector;
  isr_ = s.isr;
  for (uint16_t i = 0; i < nq_; i++) {
    queues_[i].cfg = s.queues[i];
    queues_[i].vector = s.vectors[i] < nvec_ ? s.vectors[i] : kNoVector;
  }
  {
    std::lock_guard<std::mutex> l(msix_mu_);
    table_ = s.msix_table;
    for (size_t i = 0; i < pending_.size(); i++) pending_[i] = s.msix_pending[i] != 0;
  }
  active_ = s.active;
  if (active_ && !needs_reset_) restore_device(mem_, [this](uint16_t q) { NotifyQueue(q); });
  return "";
}

void VirtioPciDevice::OnConfigWrite(uint32_t off, uint32_t size) {
  if (!msix_cap_ || off + size <= uint32_t(msix_cap_) + 2 || off > uint32_t(msix_cap_) + 3) return;
  std::lock_guard<std::mutex> l(msix_mu_);
  uint8_t hi = cfg_[msix_cap_ + 3];
  msix_enabled_ = hi & 0x80;
  msix_masked_ = hi & 0x40;
  DeliverPendingLocked();
}

}  // namespace forkling::vmm
