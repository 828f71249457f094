// Linux x86-64 kernel loading without KVM: parses a bzImage (boot protocol
// setup header) or a vmlinux ELF, copies it into guest memory, and writes the
// boot_params "zero page", the command line, the e820 map, the identity page
// tables and the GDT that the 64-bit entry point expects. Pure functions over
// a GuestMemory, so they are unit-tested on a plain buffer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "vmm/guest_memory.h"

namespace forkling::vmm {

struct ElfSegment {
  uint64_t file_offset = 0;
  uint64_t paddr = 0;
  uint64_t filesz = 0;
  uint64_t memsz = 0;
};

struct KernelInfo {
  enum class Kind { kBzImage, kElf } kind = Kind::kBzImage;
  // bzImage: from the setup header.
  uint16_t protocol = 0;          // e.g. 0x020f
  uint32_t setup_sects = 0;
  uint64_t payload_offset = 0;    // file offset of the protected-mode kernel
  uint64_t payload_size = 0;
  uint8_t loadflags = 0;
  uint16_t xloadflags = 0;
  bool relocatable = false;
  uint32_t kernel_alignment = 0;
  uint32_t initrd_addr_max = 0;   // highest byte an initrd may occupy
  uint32_t cmdline_size = 0;      // without the NUL
  uint64_t pref_address = 0;
  uint32_t init_size = 0;         // bytes the kernel needs from its load address
  uint32_t header_end = 0;        // file offset after the setup header (0x202 + jump byte)
  // ELF: loadable segments and the physical entry point.
  std::vector<ElfSegment> segments;
  uint64_t elf_entry = 0;
};

struct E820Entry {
  uint64_t addr;
  uint64_t size;
  uint32_t type;  // 1 RAM, 2 reserved
};
inline constexpr uint32_t kE820Ram = 1;
inline constexpr uint32_t kE820Reserved = 2;

// Fills `out` from the file bytes. False with a message for anything this VMM
// cannot boot (not a kernel, a 32-bit-only bzImage, boot protocol < 2.06...).
bool ParseKernel(const uint8_t* data, size_t len, KernelInfo* out, std::string* err);

struct LoadedKernel {
  uint64_t entry = 0;  // 64-bit entry point (guest-physical)
  uint64_t end = 0;    // first byte above everything the kernel may use while booting
};

// Copies the kernel into guest memory. The bzImage payload goes to 1 MiB; its
// end accounts for where the decompressor runs (pref_address + init_size).
bool LoadKernel(const GuestMemory& mem, const uint8_t* data, size_t len, const KernelInfo& k,
                LoadedKernel* out, std::string* err);

// Where to put an initrd of `size` bytes: as high as possible below both the
// end of low RAM and the kernel's initrd_addr_max, page aligned, above
// kernel_end. 0 when it does not fit.
uint64_t PlaceInitrd(const KernelInfo& k, uint64_t low_ram_end, uint64_t kernel_end, uint64_t size);

// The e820 map for `ram_size` bytes of RAM split around the PCI hole.
std::vector<E820Entry> BuildE820(uint64_t ram_size);

// Writes the zero page (setup header copied from a bzImage, or a synthetic one
// for ELF), the command line and the e820 map.
bool WriteBootParams(const GuestMemory& mem, const uint8_t* data, size_t len, const KernelInfo& k,
                     const std::string& cmdline, uint64_t initrd_addr, uint64_t initrd_size,
                     const std::vector<E820Entry>& e820, std::string* err);

// Identity page tables for the first 4 GiB (2 MiB pages) and the boot GDT
// (null, null, code64 at 0x10 = __BOOT_CS, data at 0x18 = __BOOT_DS, TSS at 0x20).
bool WriteBootPageTablesAndGdt(const GuestMemory& mem, std::string* err);

// The GDT entries as written, for setting up segment registers.
inline constexpr uint64_t kGdtEntries[5] = {
    0,
    0,
    0x00af9b000000ffffull,  // code: base 0, limit 0xfffff, G, L, P, DPL0, exec/read, accessed
    0x00cf93000000ffffull,  // data: base 0, limit 0xfffff, G, D/B, P, DPL0, read/write, accessed
    0x008f8b000000ffffull,  // TSS: busy 64-bit TSS (type 11), present
};
inline constexpr uint16_t kBootCs = 0x10;
inline constexpr uint16_t kBootDs = 0x18;
inline constexpr uint16_t kBootTss = 0x20;

// Boot protocol offsets in the zero page (and in the bzImage file for the header).
namespace bp {
inline constexpr uint32_t kExtRamdiskImage = 0x0c0;
inline constexpr uint32_t kExtRamdiskSize = 0x0c4;
inline constexpr uint32_t kExtCmdLinePtr = 0x0c8;
inline constexpr uint32_t kE820Entries = 0x1e8;
inline constexpr uint32_t kSetupSects = 0x1f1;
inline constexpr uint32_t kBootFlag = 0x1fe;
inline constexpr uint32_t kJump = 0x200;
inline constexpr uint32_t kHeader = 0x202;
inline constexpr uint32_t kVersion = 0x206;
inline constexpr uint32_t kTypeOfLoader = 0x210;
inline constexpr uint32_t kLoadFlags = 0x211;
inline constexpr uint32_t kCode32Start = 0x214;
inline constexpr uint32_t kRamdiskImage = 0x218;
inline constexpr uint32_t kRamdiskSize = 0x21c;
inline constexpr uint32_t kHeapEndPtr = 0x224;
inline constexpr uint32_t kCmdLinePtr = 0x228;
inline constexpr uint32_t kInitrdAddrMax = 0x22c;
inline constexpr uint32_t kKernelAlignment = 0x230;
inline constexpr uint32_t kRelocatable = 0x234;
inline constexpr uint32_t kXLoadFlags = 0x236;
inline constexpr uint32_t kCmdlineSize = 0x238;
inline constexpr uint32_t kPrefAddress = 0x258;
inline constexpr uint32_t kInitSize = 0x260;
inline constexpr uint32_t kE820Table = 0x2d0;
inline constexpr uint32_t kE820Max = 128;
}  // namespace bp

}  // namespace forkling::vmm
