#include "vmm/boot_loader.h"

#include <algorithm>
#include <cstring>
#include <elf.h>

#include "vmm/layout.h"

namespace forkling::vmm {
namespace {

template <class T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

constexpr uint32_t kHdrS = 0x53726448;  // "HdrS"
constexpr uint8_t kLoadedHigh = 0x01;
constexpr uint8_t kCanUseHeap = 0x80;
constexpr uint16_t kXlfKernel64 = 0x01;
constexpr uint64_t kPage = 4096;

bool ParseBzImage(const uint8_t* d, size_t len, KernelInfo* k, std::string* err) {
  if (len < 0x1000) {
    *err = "kernel file is too small to be a bzImage";
    return false;
  }
  if (Get<uint16_t>(d + bp::kBootFlag) != 0xaa55 || Get<uint32_t>(d + bp::kHeader) != kHdrS) {
    *err = "not a Linux bzImage (no boot sector signature or HdrS header)";
    return false;
  }
  k->kind = KernelInfo::Kind::kBzImage;
  k->protocol = Get<uint16_t>(d + bp::kVersion);
  // 2.12 added xloadflags (64-bit entry); 2.10 pref_address and init_size.
  if (k->protocol < 0x020c) {
    *err = "bzImage boot protocol " + std::to_string(k->protocol >> 8) + "." +
           std::to_string(k->protocol & 0xff) + " is too old (need 2.12 or later, Linux 3.8+)";
    return false;
  }
  k->setup_sects = d[bp::kSetupSects] ? d[bp::kSetupSects] : 4;
  k->payload_offset = uint64_t(k->setup_sects + 1) * 512;
  if (k->payload_offset >= len) {
    *err = "bzImage setup_sects points past the end of the file";
    return false;
  }
  k->payload_size = len - k->payload_offset;
  k->loadflags = d[bp::kLoadFlags];
  k->xloadflags = Get<uint16_t>(d + bp::kXLoadFlags);
  if (!(k->xloadflags & kXlfKernel64)) {
    *err = "bzImage has no 64-bit entry point (xloadflags XLF_KERNEL_64 not set)";
    return false;
  }
  if (!(k->loadflags & kLoadedHigh)) {
    *err = "bzImage is not a 'loaded high' kernel";
    return false;
  }
  k->relocatable = d[bp::kRelocatable] != 0;
  k->kernel_alignment = Get<uint32_t>(d + bp::kKernelAlignment);
  k->initrd_addr_max = Get<uint32_t>(d + bp::kInitrdAddrMax);
  k->cmdline_size = Get<uint32_t>(d + bp::kCmdlineSize);
  k->pref_address = Get<uint64_t>(d + bp::kPrefAddress);
  k->init_size = Get<uint32_t>(d + bp::kInitSize);
  // The header ends at 0x202 + the jump instruction's displacement byte.
  k->header_end = 0x202 + d[0x201];
  if (k->header_end > 0x280 || k->header_end <= bp::kInitSize + 4) {
    *err = "bzImage setup header has an implausible length";
    return false;
  }
  if (!k->relocatable && k->pref_address != layout::kHighMem) {
    // A non-relocatable kernel must run where it was linked; we load at 1 MiB.
    *err = "bzImage is not relocatable";
    return false;
  }
  return true;
}

bool ParseElf(const uint8_t* d, size_t len, KernelInfo* k, std::string* err) {
  if (len < sizeof(Elf64_Ehdr)) {
    *err = "ELF file is truncated";
    return false;
  }
  Elf64_Ehdr eh = Get<Elf64_Ehdr>(d);
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_ident[EI_DATA] != ELFDATA2LSB || eh.e_machine != EM_X86_64) {
    *err = "ELF kernel is not a 64-bit little-endian x86-64 image";
    return false;
  }
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 || eh.e_phnum > 64 || eh.e_phoff > len ||
      uint64_t(eh.e_phnum) * sizeof(Elf64_Phdr) > len - eh.e_phoff) {
    *err = "ELF program headers are missing or out of the file";
    return false;
  }
  k->kind = KernelInfo::Kind::kElf;
  k->segments.clear();
  for (uint16_t i = 0; i < eh.e_phnum; i++) {
    Elf64_Phdr ph = Get<Elf64_Phdr>(d + eh.e_phoff + uint64_t(i) * sizeof(Elf64_Phdr));
    if (ph.p_type != PT_LOAD) continue;
    if (ph.p_filesz > ph.p_memsz || ph.p_offset > len || ph.p_filesz > len - ph.p_offset ||
        ph.p_paddr + ph.p_memsz < ph.p_paddr) {
      *err = "ELF segment " + std::to_string(i) + " lies outside the file or wraps";
      return false;
    }
    k->segments.push_back({ph.p_offset, ph.p_paddr, ph.p_filesz, ph.p_memsz});
  }
  if (k->segments.empty()) {
    *err = "ELF kernel has no PT_LOAD segment";
    return false;
  }
  // vmlinux links with ENTRY(phys_startup_64): e_entry is already physical.
  k->elf_entry = eh.e_entry;
  k->cmdline_size = 2047;
  k->initrd_addr_max = 0x7fffffff;
  k->kernel_alignment = 0x200000;
  return true;
}

}  // namespace

bool ParseKernel(const uint8_t* data, size_t len, KernelInfo* out, std::string* err) {
  *out = KernelInfo{};
  if (len >= 4 && std::memcmp(data, ELFMAG, SELFMAG) == 0) return ParseElf(data, len, out, err);
  return ParseBzImage(data, len, out, err);
}

bool LoadKernel(const GuestMemory& mem, const uint8_t* data, size_t len, const KernelInfo& k,
                LoadedKernel* out, std::string* err) {
  if (k.kind == KernelInfo::Kind::kBzImage) {
    if (!mem.WriteBytes(layout::kHighMem, data + k.payload_offset, k.payload_size)) {
      *err = "guest memory too small for the kernel image";
      return false;
    }
    out->entry = layout::kHighMem + 0x200;  // startup_64 of the compressed kernel
    // The decompressor moves to max(load address, pref_address) and needs init_size from there.
    uint64_t run_at = std::max<uint64_t>(layout::kHighMem, k.pref_address);
    out->end = std::max<uint64_t>(layout::kHighMem + k.payload_size, run_at + k.init_size);
    if (!mem.Contains(0, out->end)) {
      *err = "guest memory too small: the kernel needs " + std::to_string(out->end >> 20) + " MiB to boot";
      return false;
    }
    return true;
  }
  uint64_t end = 0;
  for (const ElfSegment& s : k.segments) {
    uint8_t* dst = mem.Ptr(s.paddr, s.memsz);
    if (!dst) {
      *err = "ELF segment at " + std::to_string(s.paddr) + " does not fit in guest memory";
      return false;
    }
    std::memcpy(dst, data + s.file_offset, s.filesz);
    std::memset(dst + s.filesz, 0, s.memsz - s.filesz);
    end = std::max(end, s.paddr + s.memsz);
  }
  if (!mem.Contains(k.elf_entry, 1)) {
    *err = "ELF entry point is outside guest memory";
    return false;
  }
  out->entry = k.elf_entry;
  out->end = end;
  return true;
}

uint64_t PlaceInitrd(const KernelInfo& k, uint64_t low_ram_end, uint64_t kernel_end, uint64_t size) {
  if (size == 0) return 0;
  uint64_t limit = std::min<uint64_t>(low_ram_end, uint64_t(k.initrd_addr_max) + 1);
  if (size > limit) return 0;
  uint64_t addr = (limit - size) & ~(kPage - 1);
  kernel_end = (kernel_end + kPage - 1) & ~(kPage - 1);
  if (addr < kernel_end) return 0;
  return addr;
}

std::vector<E820Entry> BuildE820(uint64_t ram_size) {
  std::vector<E820Entry> e;
  e.push_back({0, layout::kEbda, kE820Ram});
  e.push_back({layout::kEbda, layout::kHighMem - layout::kEbda, kE820Reserved});
  uint64_t low = std::min(ram_size, layout::kPciHole);
  if (low > layout::kHighMem) e.push_back({layout::kHighMem, low - layout::kHighMem, kE820Ram});
  if (ram_size > layout::kPciHole) e.push_back({layout::kHighRam, ram_size - layout::kPciHole, kE820Ram});
  return e;
}

bool WriteBootParams(const GuestMemory& mem, const uint8_t* data, size_t len, const KernelInfo& k,
                     const std::string& cmdline, uint64_t initrd_addr, uint64_t initrd_size,
                     const std::vector<E820Entry>& e820, std::string* err) {
  uint8_t zp[4096] = {};
  if (k.kind == KernelInfo::Kind::kBzImage) {
    if (k.header_end > len) {
      *err = "bzImage setup header is truncated";
      return false;
    }
    std::memcpy(zp + bp::kSetupSects, data + bp::kSetupSects, k.header_end - bp::kSetupSects);
  } else {
    // vmlinux has no setup header: synthesize the fields the kernel reads.
    Put<uint16_t>(zp + bp::kBootFlag, 0xaa55);
    Put<uint32_t>(zp + bp::kHeader, kHdrS);
    Put<uint32_t>(zp + bp::kKernelAlignment, k.kernel_alignment);
  }
  zp[bp::kTypeOfLoader] = 0xff;  // "undefined" boot loader
  zp[bp::kLoadFlags] |= kLoadedHigh | kCanUseHeap;
  Put<uint16_t>(zp + bp::kHeapEndPtr, 0xfe00);
  Put<uint32_t>(zp + bp::kCode32Start, uint32_t(layout::kHighMem));

  uint32_t max_cmdline = k.cmdline_size ? k.cmdline_size : 255;
  if (cmdline.size() > max_cmdline || cmdline.size() + 1 > layout::kCmdlineMax) {
    *err = "kernel command line is " + std::to_string(cmdline.size()) + " bytes; this kernel takes at most " +
           std::to_string(max_cmdline);
    return false;
  }
  if (cmdline.find('\0') != std::string::npos) {
    *err = "kernel command line contains a NUL byte";
    return false;
  }
  if (!mem.WriteBytes(layout::kCmdline, cmdline.c_str(), cmdline.size() + 1)) {
    *err = "guest memory too small for the command line";
    return false;
  }
  Put<uint32_t>(zp + bp::kCmdLinePtr, uint32_t(layout::kCmdline));

  if (initrd_size) {
    if (!mem.Contains(initrd_addr, initrd_size) || initrd_addr + initrd_size > (1ull << 32)) {
      *err = "initrd does not lie in guest RAM below 4 GiB";
      return false;
    }
    Put<uint32_t>(zp + bp::kRamdiskImage, uint32_t(initrd_addr));
    Put<uint32_t>(zp + bp::kRamdiskSize, uint32_t(initrd_size));
  }

  if (e820.size() > bp::kE820Max) {
    *err = "too many e820 entries";
    return false;
  }
  zp[bp::kE820Entries] = uint8_t(e820.size());
  for (size_t i = 0; i < e820.size(); i++) {
    uint8_t* p = zp + bp::kE820Table + i * 20;
    Put<uint64_t>(p, e820[i].addr);
    Put<uint64_t>(p + 8, e820[i].size);
    Put<uint32_t>(p + 16, e820[i].type);
  }
  if (!mem.WriteBytes(layout::kBootParams, zp, sizeof zp)) {
    *err = "guest memory too small for boot_params";
    return false;
  }
  return true;
}

bool WriteBootPageTablesAndGdt(const GuestMemory& mem, std::string* err) {
  constexpr uint64_t kPresentRw = 0x3, kHuge = 0x80;
  uint8_t* pml4 = mem.Ptr(layout::kPml4, kPage);
  uint8_t* pdpt = mem.Ptr(layout::kPdpt, kPage);
  uint8_t* pd = mem.Ptr(layout::kPd, 4 * kPage);
  uint8_t* gdt = mem.Ptr(layout::kGdt, sizeof kGdtEntries);
  uint8_t* idt = mem.Ptr(layout::kIdt, 8);
  if (!pml4 || !pdpt || !pd || !gdt || !idt) {
    *err = "guest memory too small for the boot page tables";
    return false;
  }
  std::memset(pml4, 0, kPage);
  std::memset(pdpt, 0, kPage);
  Put<uint64_t>(pml4, layout::kPdpt | kPresentRw);
  for (uint64_t i = 0; i < 4; i++) {
    Put<uint64_t>(pdpt + i * 8, (layout::kPd + i * kPage) | kPresentRw);
    for (uint64_t j = 0; j < 512; j++) {
      Put<uint64_t>(pd + i * kPage + j * 8, ((i * 512 + j) << 21) | kPresentRw | kHuge);
    }
  }
  std::memcpy(gdt, kGdtEntries, sizeof kGdtEntries);
  Put<uint64_t>(idt, 0);
  return true;
}

}  // namespace forkling::vmm
