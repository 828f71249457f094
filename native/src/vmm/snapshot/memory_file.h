// The template memory file: guest RAM byte for byte at its offsets, written
// sparse (all-zero pages stay holes, so a guest that zeroes what it frees,
// e.g. with init_on_free=1, costs nothing for those pages), and a checksum.
//
// Checksum: CRC32C over, for each non-zero page in ascending order, its page
// number (u64, little-endian) and its 4096 bytes. Zero pages are skipped both
// when writing and when verifying, so where a filesystem stores zeros (a hole
// or real zero blocks) does not matter. The state file records the size, the
// count of non-zero pages and the checksum.
//
// Verification reads every data page once (several GB/s with the CRC32C
// instruction; it also brings the file into the page cache, which the first
// children want anyway). It runs once per process per file: the result is
// cached by device, inode, size, mtime and ctime, so a changed file is checked
// again.
#pragma once
#include <cstdint>
#include <string>

namespace forkling::vmm::snapshot {

inline constexpr uint64_t kPageSize = 4096;

struct MemoryFileInfo {
  uint64_t size = 0;        // bytes (the guest RAM size)
  uint64_t data_pages = 0;  // non-zero pages
  uint32_t checksum = 0;
};

// Writes [host, host+size) to a new file at `path` (created or truncated).
// `src_fd`, when >= 0, is the file behind the mapping (the VM's memfd): its
// holes (never-touched RAM) are skipped with SEEK_DATA/SEEK_HOLE without
// reading them. The guest must be paused. Throws std::system_error.
MemoryFileInfo WriteMemoryFile(const uint8_t* host, uint64_t size, int src_fd, const std::string& path);

// Computes the info of an open file (reads it through fd, opened with
// OpenStoreFile; `path` names it in errors). Throws CorruptError (naming `what`) when it cannot be read.
MemoryFileInfo ScanMemoryFile(int fd, const std::string& path, const std::string& what);

// Throws CorruptError ("<what> is corrupt: memory file ...") unless the open
// file matches `expected`: what is checked is what the caller maps. Cached
// per process as described above (by the fd's device, inode, size and times).
void VerifyMemoryFile(int fd, const std::string& path, const MemoryFileInfo& expected, const std::string& what);

// For tests: forget the cache.
void ClearVerifyCache();

}  // namespace forkling::vmm::snapshot
