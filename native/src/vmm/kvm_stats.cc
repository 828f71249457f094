#include "vmm/kvm_stats.h"

#include <linux/kvm.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace forkling::vmm {

KvmStats::KvmStats(int fd) : fd_(fd) {
  if (fd_ < 0) return;
  kvm_stats_header h;
  if (pread(fd_, &h, sizeof h, 0) != ssize_t(sizeof h) || h.name_size == 0 || h.name_size > 4096 || h.num_desc > 4096) {
    close(fd_);
    fd_ = -1;
    return;
  }
  const size_t each = sizeof(kvm_stats_desc) + h.name_size;
  std::vector<char> descs(each * h.num_desc);
  if (pread(fd_, descs.data(), descs.size(), h.desc_offset) != ssize_t(descs.size())) {
    close(fd_);
    fd_ = -1;
    return;
  }
  data_offset_ = h.data_offset;
  for (uint32_t i = 0; i < h.num_desc; i++) {
    const auto* d = reinterpret_cast<const kvm_stats_desc*>(descs.data() + i * each);
    if (d->size != 1) continue;  // only plain u64 counters
    offsets_[std::string(d->name, strnlen(d->name, h.name_size))] = d->offset;
  }
}

KvmStats::~KvmStats() {
  if (fd_ >= 0) close(fd_);
}

int64_t KvmStats::Read(const std::string& name) const {
  auto it = offsets_.find(name);
  if (fd_ < 0 || it == offsets_.end()) return -1;
  uint64_t v = 0;
  if (pread(fd_, &v, sizeof v, off_t(data_offset_ + it->second)) != ssize_t(sizeof v)) return -1;
  return int64_t(v);
}

}  // namespace forkling::vmm
