// The snapshot state file: a small container of tagged sections.
//
//   header   "FKLSTATE" | u32 version | u32 section count | u64 file size
//   section  u32 tag | u32 index | u64 length | u32 crc32c(data) | u32 0 | data, padded to 8
//   trailer  u32 crc32c(everything before) | "FKLE"
//
// All integers little-endian. A reader refuses a file whose magic, version,
// size, any section checksum or the file checksum does not match, with an
// error that names what was being loaded ("template X is corrupt: ...").
// ByteWriter/ByteReader serialise plain structs into section payloads; the
// reader checks every length, so a corrupt payload is an error, never an
// out-of-bounds read.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace forkling::vmm::snapshot {

inline constexpr uint32_t kStateFormatVersion = 1;

// Thrown for any file that is missing, truncated or fails a check.
class CorruptError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Section {
  uint32_t tag = 0;
  uint32_t index = 0;  // e.g. the vCPU number; 0 for singletons
  std::vector<uint8_t> data;
};

// Section tags (four characters, readable in a hex dump).
constexpr uint32_t Tag(const char (&s)[5]) {
  return uint32_t(uint8_t(s[0])) | uint32_t(uint8_t(s[1])) << 8 | uint32_t(uint8_t(s[2])) << 16 |
         uint32_t(uint8_t(s[3])) << 24;
}

std::vector<uint8_t> EncodeStateFile(const std::vector<Section>& sections);
// `what` names the thing for errors, e.g. "template py".
std::vector<Section> DecodeStateFile(const uint8_t* data, size_t len, const std::string& what);

// Whole-file helpers. Write is plain (the caller makes it atomic, e.g. by
// writing into a directory that is renamed into place); Read throws
// CorruptError for a missing or bad file.
void WriteStateFile(const std::string& path, const std::vector<Section>& sections);
std::vector<Section> ReadStateFile(const std::string& path, const std::string& what);

// Opens a file of a template (or the template's directory, with O_DIRECTORY
// in `flags`) to read: never blocks (a FIFO put there would hang the caller),
// and refuses (CorruptError naming `what` and the file's `kind`: "memory
// file", ...; a missing one is said to be missing) anything but a regular
// file (or directory) owned by us or root that no other user may write:
// whoever may write it may change what every child of the template maps as
// its memory.
int OpenStoreFile(const std::string& path, const std::string& what, const std::string& kind, int flags = 0);

// First section with `tag` (and index), or nullptr.
const Section* FindSection(const std::vector<Section>& s, uint32_t tag, uint32_t index = 0);

// A bool inside a struct copied from a file: only the bytes 0 and 1 are a bool
// (any other is undefined behaviour once read as one), so it is looked at as a byte first.
inline void CheckFlag(const bool& b, const std::string& what) {
  uint8_t v;
  std::memcpy(&v, &b, 1);
  if (v > 1) throw CorruptError(what + ": a flag is neither 0 nor 1");
}

class ByteWriter {
 public:
  template <class T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    PutBytes(&v, sizeof v);
  }
  void PutBytes(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  // Length-prefixed (u32) blob.
  void PutBlob(const void* p, size_t n) {
    Put(uint32_t(n));
    PutBytes(p, n);
  }
  void PutString(const std::string& s) { PutBlob(s.data(), s.size()); }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class ByteReader {
 public:
  ByteReader(const std::vector<uint8_t>& b, std::string what) : p_(b.data()), n_(b.size()), what_(std::move(what)) {}
  template <class T>
  T Get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    GetBytes(&v, sizeof v);
    return v;
  }
  void GetBytes(void* out, size_t n) {
    if (n > n_ - off_) throw CorruptError(what_ + ": section is truncated");
    std::memcpy(out, p_ + off_, n);
    off_ += n;
  }
  // A blob no longer than `max` bytes.
  std::vector<uint8_t> GetBlob(size_t max) {
    uint32_t n = Get<uint32_t>();
    if (n > max) throw CorruptError(what_ + ": a field is larger than allowed");
    std::vector<uint8_t> v(n);
    GetBytes(v.data(), n);
    return v;
  }
  std::string GetString(size_t max) {
    std::vector<uint8_t> v = GetBlob(max);
    return std::string(v.begin(), v.end());
  }
  bool done() const { return off_ == n_; }
  void ExpectDone() const {
    if (!done()) throw CorruptError(what_ + ": section has trailing bytes");
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  std::string what_;
};

}  // namespace forkling::vmm::snapshot
