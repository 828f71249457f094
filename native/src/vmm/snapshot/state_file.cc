#include "vmm/snapshot/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>

#include "vmm/snapshot/bytes.h"
#include "vmm/snapshot/checksum.h"

namespace forkling::vmm::snapshot {
namespace {

constexpr char kMagic[8] = {'F', 'K', 'L', 'S', 'T', 'A', 'T', 'E'};
constexpr char kEndMagic[4] = {'F', 'K', 'L', 'E'};
constexpr size_t kHeaderSize = 8 + 4 + 4 + 8;
constexpr size_t kSectionHeaderSize = 4 + 4 + 8 + 4 + 4;
constexpr size_t kTrailerSize = 8;
// A state file holds registers and device state: kilobytes per vCPU. Anything
// near this is not one of ours.
constexpr size_t kMaxStateFile = 64u << 20;


}  // namespace

std::vector<uint8_t> EncodeStateFile(const std::vector<Section>& sections) {
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), kMagic, 8);
  Append<uint32_t>(b, kStateFormatVersion);
  Append<uint32_t>(b, uint32_t(sections.size()));
  Append<uint64_t>(b, 0);  // file size, patched below
  for (const Section& s : sections) {
    Append<uint32_t>(b, s.tag);
    Append<uint32_t>(b, s.index);
    Append<uint64_t>(b, s.data.size());
    Append<uint32_t>(b, Crc32c(s.data.data(), s.data.size()));
    Append<uint32_t>(b, 0);
    b.insert(b.end(), s.data.begin(), s.data.end());
    while (b.size() % 8) b.push_back(0);
  }
  uint64_t total = b.size() + kTrailerSize;
  std::memcpy(b.data() + 16, &total, 8);
  Append<uint32_t>(b, Crc32c(b.data(), b.size()));
  for (char c : kEndMagic) b.push_back(uint8_t(c));
  return b;
}

std::vector<Section> DecodeStateFile(const uint8_t* p, size_t len, const std::string& what) {
  auto bad = [&](const std::string& why) { return CorruptError(what + " is corrupt: state file " + why); };
  if (len < kHeaderSize + kTrailerSize) throw bad("is truncated (" + std::to_string(len) + " bytes)");
  if (std::memcmp(p, kMagic, 8) != 0) throw bad("is not a forkling state file (bad magic)");
  uint32_t version = Load<uint32_t>(p + 8);
  if (version != kStateFormatVersion)
    throw bad("has format version " + std::to_string(version) + ", this forkling reads version " +
              std::to_string(kStateFormatVersion) + " (create the template again)");
  uint32_t count = Load<uint32_t>(p + 12);
  uint64_t size = Load<uint64_t>(p + 16);
  if (size != len)
    throw bad(size > len ? "is truncated (" + std::to_string(len) + " of " + std::to_string(size) + " bytes)"
                         : "has " + std::to_string(len - size) + " bytes too many");
  if (std::memcmp(p + len - 4, kEndMagic, 4) != 0) throw bad("has no end marker");
  if (Load<uint32_t>(p + len - 8) != Crc32c(p, len - kTrailerSize)) throw bad("fails its checksum");
  std::vector<Section> out;
  size_t off = kHeaderSize;
  const size_t end = len - kTrailerSize;
  for (uint32_t i = 0; i < count; i++) {
    if (end - off < kSectionHeaderSize) throw bad("has a truncated section table");
    Section s;
    s.tag = Load<uint32_t>(p + off);
    s.index = Load<uint32_t>(p + off + 4);
    uint64_t n = Load<uint64_t>(p + off + 8);
    uint32_t crc = Load<uint32_t>(p + off + 16);
    off += kSectionHeaderSize;
    if (n > end - off) throw bad("has a section longer than the file");
    if (Crc32c(p + off, n) != crc) throw bad("has a section that fails its checksum");
    s.data.assign(p + off, p + off + n);
    off += n;
    off = (off + 7) & ~size_t(7);
    if (off > end) throw bad("has a section longer than the file");
    out.push_back(std::move(s));
  }
  if (off != end) throw bad("has bytes after its last section");
  return out;
}

void WriteStateFile(const std::string& path, const std::vector<Section>& sections) {
  std::vector<uint8_t> b = EncodeStateFile(sections);
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "cannot create " + path);
  size_t done = 0;
  while (done < b.size()) {
    ssize_t n = write(fd, b.data() + done, b.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      throw std::system_error(e, std::generic_category(), "cannot write " + path);
    }
    done += size_t(n);
  }
  if (fsync(fd) != 0 && errno != EINVAL) {
    int e = errno;
    close(fd);
    throw std::system_error(e, std::generic_category(), "cannot sync " + path);
  }
  close(fd);
}

int OpenStoreFile(const std::string& path, const std::string& what, const std::string& kind, int flags) {
  const bool dir = (flags & O_DIRECTORY) != 0;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | flags);
  if (fd < 0)
    throw CorruptError(what + " is corrupt: " + kind + " " + path + (errno == ENOENT ? " is missing (" : " cannot be opened (") +
                       std::strerror(errno) + ")");
  struct stat st;
  std::string why;
  if (fstat(fd, &st) != 0) why = std::string("cannot be read: ") + std::strerror(errno);
  else if (!(dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode))) why = dir ? "is not a directory" : "is not a regular file";
  else if (st.st_uid != geteuid() && st.st_uid != 0) why = "belongs to another user (uid " + std::to_string(st.st_uid) + ")";
  else if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    char mode[8];
    snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    why = std::string("may be written by other users (mode ") + mode + "; chmod go-w " + path + ")";
  }
  if (!why.empty()) {
    close(fd);
    throw CorruptError(what + " is refused: " + kind + " " + path + " " + why);
  }
  return fd;
}

std::vector<Section> ReadStateFile(const std::string& path, const std::string& what) {
  int fd = OpenStoreFile(path, what, "state file");
  struct stat st;
  if (fstat(fd, &st) != 0 || uint64_t(st.st_size) > kMaxStateFile) {
    close(fd);
    throw CorruptError(what + " is corrupt: state file " + path + " is unreadable or too large");
  }
  std::vector<uint8_t> b(size_t(st.st_size));
  size_t got = 0;
  while (got < b.size()) {
    ssize_t n = pread(fd, b.data() + got, b.size() - got, off_t(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  close(fd);
  b.resize(got);
  return DecodeStateFile(b.data(), b.size(), what);
}

const Section* FindSection(const std::vector<Section>& s, uint32_t tag, uint32_t index) {
  for (const Section& x : s)
    if (x.tag == tag && x.index == index) return &x;
  return nullptr;
}

}  // namespace forkling::vmm::snapshot
