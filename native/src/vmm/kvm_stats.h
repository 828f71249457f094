// KVM's binary statistics of a VM (KVM_GET_STATS_FD, Linux 5.14+): named
// u64 counters read with pread. Used for KVM's own figures of a VM's memory:
// the pages its nested page table maps at each size.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace forkling::vmm {

class KvmStats {
 public:
  // fd: from ioctl(vm_fd, KVM_GET_STATS_FD); taken over. A fd < 0 (an old
  // kernel) reads nothing.
  explicit KvmStats(int fd);
  ~KvmStats();
  KvmStats(const KvmStats&) = delete;
  KvmStats& operator=(const KvmStats&) = delete;
  bool ok() const { return fd_ >= 0; }
  // The counter's value now, or -1 when the kernel has no such counter.
  int64_t Read(const std::string& name) const;

 private:
  int fd_ = -1;
  uint64_t data_offset_ = 0;
  std::map<std::string, uint64_t> offsets_;  // name -> offset in the data block
};

}  // namespace forkling::vmm
