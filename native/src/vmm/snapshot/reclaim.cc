#include "vmm/snapshot/reclaim.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "vmm/snapshot/diff_layer.h"
#include "vmm/snapshot/pagemap.h"
#include "vmm/snapshot/pattern.h"
#include "vmm/snapshot/snapshot_pages.h"

namespace forkling::vmm::snapshot {
namespace {

constexpr uint64_t kPage = 4096;
// Candidates compared again per pause: 4 MiB of page copies at most.
constexpr size_t kChunkPages = 1024;
// Pagemap read per step: 128 MiB of RAM.
constexpr uint64_t kWindowPages = 32768;

[[noreturn]] void Fail(const char* what) { throw std::system_error(errno, std::generic_category(), what); }

bool IsZero(const uint8_t* p) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t acc = 0;
  for (size_t i = 0; i < kPage / 8; i++) acc |= w[i];
  return acc == 0;
}

using Clock = std::chrono::steady_clock;
uint64_t Ns(Clock::time_point a, Clock::time_point b) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
}

void AddPause(ReclaimResult& r, uint64_t held_ns) {
  r.pause_ns += held_ns;
  r.longest_pause_ns = std::max(r.longest_pause_ns, held_ns);
}

// Whether `bytes` are the snapshot's page `page` (`buf`: a page to read into). A private page
// that holds them again is given back to the snapshot, not bridged.
bool HoldsSnapshot(const SnapshotPages& snap, const uint8_t* bytes, uint8_t* buf, uint64_t page) {
  return snap.Read(page, buf) ? std::memcmp(bytes, buf, kPage) == 0 : IsZero(bytes);
}

// Maps the pattern's runs, within RAM pages [from, to), over the VM's pages
// where these hold the pattern's bytes, if that shares at least one private
// page (`priv`, sorted). Compared while the guest runs (a page not private is
// the snapshot's: compared with that, not faulted into the mapping), then
// again held still, as for dropping. A short gap of private pages that hold
// other bytes is bridged: mapped with the rest and its bytes written back
// (private before and after), so that a run costs one mapping, not one per
// stretch between such pages (each VM has kPatternMapsPerVm). Adds the pages
// now shared with the pattern to `mapped` and returns the page to go on from
// (`to`: done).
uint64_t MapPattern(Vm& vm, PatternBacking& pb, const SnapshotPages& snap, const std::vector<uint64_t>& priv, uint64_t from,
                    uint64_t to, ReclaimResult& r, std::vector<uint64_t>& mapped) {
  const DiffLayer& layer = pb.layer();
  const GuestRam& ram = vm.ram();
  const uint64_t ram_pages = ram.size() / kPage;
  auto is_priv = [&](uint64_t p) { return std::binary_search(priv.begin(), priv.end(), p); };
  struct Span {
    uint64_t page = 0, count = 0;
    size_t copy = 0;    // its first page in `copies`
    uint64_t gain = 0;  // private pages in it that hold the pattern's bytes
  };
  std::vector<Span> spans;
  // The pattern's bytes of every span page; not zero-filled: only the slots used are written.
  std::unique_ptr<uint8_t[]> copies(new uint8_t[(kChunkPages + 1) * kPage]);
  uint8_t* const snap_page = copies.get() + kChunkPages * kPage;
  // Whether private page `p`, whose bytes are not the pattern's, may be bridged (the same rule
  // while the guest runs and again held still): inside a run (`run`: its pages so far), after
  // fewer than kPatternMaxBridge such pages in a row (`tail`), unless it holds the snapshot's
  // bytes again (it is given back to the snapshot instead; `had`: mapped from the pattern now).
  auto bridgeable = [&](uint64_t p, bool had, uint64_t run, uint64_t tail) {
    return run && tail < kPatternMaxBridge && (had || !HoldsSnapshot(snap, ram.host() + p * kPage, snap_page, p));
  };
  size_t copied = 0;
  uint64_t next = to;
  const std::vector<DiffRun>& runs = layer.runs();
  // The first run that ends after `from` (it may begin before: a window's edge cuts it).
  auto it = std::upper_bound(runs.begin(), runs.end(), from, [](uint64_t p, const DiffRun& x) { return p < x.page + x.count; });
  for (; it != runs.end() && it->page < to; ++it) {
    const uint64_t first = std::max(it->page, from), end = std::min({it->page + it->count, to, ram_pages});
    bool any = false;  // a private page not from the pattern yet: only such a run can gain
    for (auto q = std::lower_bound(priv.begin(), priv.end(), first); q != priv.end() && *q < end && !any; ++q) any = !pb.Has(*q);
    if (!any) continue;
    Span cur;
    uint64_t tail = 0;  // bridged pages at the end of `cur`
    auto end_span = [&] {
      cur.count -= tail;
      copied -= tail;
      if (cur.gain) spans.push_back(cur);
      else copied -= cur.count;  // (the last pages copied)
      cur = Span();
      tail = 0;
    };
    uint64_t p = first;
    for (; p < end && copied < kChunkPages; p++) {
      uint8_t* c = copies.get() + copied * kPage;
      // A page mapped from the pattern already is mapped again with the rest (the same file
      // page: one mapping where there were two); one that holds the snapshot's bytes again
      // is not bridged (it is given back to the snapshot instead).
      const bool had = pb.Has(p);
      bool same = false, bridge = false;
      layer.ReadPage(p, c);
      if (is_priv(p)) {
        same = std::memcmp(ram.host() + p * kPage, c, kPage) == 0;
        bridge = !same && bridgeable(p, had, cur.count, tail);
      } else {
        same = had || HoldsSnapshot(snap, c, snap_page, p);
      }
      if (!same && !bridge) {
        end_span();
        continue;
      }
      if (!cur.count) {
        cur.page = p;
        cur.copy = copied;
      }
      cur.count++;
      copied++;
      tail = bridge ? tail + 1 : 0;
      cur.gain += same && is_priv(p) && !had;
    }
    end_span();
    if (p < end) {  // the buffer is full: the next call goes on here
      next = p;
      break;
    }
  }
  if (spans.empty()) return next;
  const size_t left = pb.MapsLeft();
  if (spans.size() > left) {  // the spans that share the most pages
    std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.gain > b.gain; });
    spans.resize(left);
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.page < b.page; });
  }

  HeldStill held(vm);
  const int base_fd = vm.origin()->memory_fd->get();
  std::vector<uint64_t> bridged;  // pages of the range being built that keep their own bytes
  for (const Span& s : spans) {
    // Which pages are private now: a page that is not holds the snapshot's bytes, compared above.
    const std::vector<uint64_t> now = PrivatePages(ram.host() + s.page * kPage, s.count * kPage);
    uint64_t start = 0, len = 0, gain = 0, tail = 0;
    auto map = [&] {
      len -= tail;
      bridged.resize(bridged.size() - tail);
      tail = 0;
      if (!gain || !pb.MapsLeft()) {
        len = gain = 0;
        bridged.clear();
        return;
      }
      const DiffRun* run = layer.Find(start);
      const off_t off = off_t(layer.data_offset() + (run->slot + start - run->page) * kPage);
      uint8_t* at = ram.host() + start * kPage;
      const uint64_t bytes = len * kPage;
      // What the bridged pages hold goes back over the pattern's bytes once mapped, whatever happens.
      std::vector<uint8_t> kept(bridged.size() * kPage);
      for (size_t i = 0; i < bridged.size(); i++) std::memcpy(kept.data() + i * kPage, ram.host() + bridged[i] * kPage, kPage);
      auto put_back = [&] {
        for (size_t i = 0; i < bridged.size(); i++) std::memcpy(ram.host() + bridged[i] * kPage, kept.data() + i * kPage, kPage);
      };
      if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, layer.fd(), off) != MAP_FAILED) {
        madvise(at, bytes, MADV_DONTDUMP);  // (as the rest of guest RAM; lets the VMAs merge)
        put_back();
        pb.Add(start, len);
        for (uint64_t i = 0, b = 0; i < len; i++) {
          if (b < bridged.size() && bridged[b] == start + i) b++;
          else mapped.push_back(start + i);
        }
        r.pattern_pages += gain;
      } else {
        // Mostly the limit on mappings (the old mapping is then intact): no more runs for this VM.
        pb.Exhaust();
        std::vector<unsigned char> in(len);
        if (mincore(at, bytes, in.data()) != 0 && errno == ENOMEM) {
          // Out of memory after the kernel unmapped the range: the memory
          // file there again, with the bytes the guest had (the pattern's,
          // and the bridged pages' own).
          if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, base_fd, off_t(start * kPage)) == MAP_FAILED) {
            held.KeepVsockHeld();  // (its loop must not touch the hole)
            vm.Fail("its RAM could not be mapped again after a failed mmap of its pattern (the host is out of memory)");
            Fail("mmap guest RAM again");
          }
          madvise(at, bytes, MADV_DONTDUMP);
          std::memcpy(at, copies.get() + (s.copy + start - s.page) * kPage, bytes);
          put_back();
          pb.Remove(start, len);  // (pages mapped from the pattern before fall back to the file now)
        }
      }
      len = gain = 0;
      bridged.clear();
    };
    for (uint64_t i = 0; i < s.count; i++) {
      const uint64_t p = s.page + i;
      const bool mine = std::binary_search(now.begin(), now.end(), i);
      const bool same = !mine || std::memcmp(ram.host() + p * kPage, copies.get() + (s.copy + i) * kPage, kPage) == 0;
      if (!same && !bridgeable(p, pb.Has(p), len, tail)) {
        map();
        continue;
      }
      if (!len) start = p;
      len++;
      if (same) {
        tail = 0;
        gain += mine && !pb.Has(p);
      } else {
        tail++;
        bridged.push_back(p);
      }
    }
    map();
  }
  AddPause(r, held.Let());
  return next;
}

}  // namespace

ReclaimResult Reclaim(Vm& vm, uint64_t from_page, uint64_t max_pages) {
  std::shared_ptr<const RestoreSpec> origin = vm.origin();
  if (!origin) throw std::runtime_error("only a VM restored from a snapshot can give pages back");
  vm.Unpack();  // (a dozing VM's packed pages: compared and mapped as what they are)
  ReclaimResult r;
  const auto t0 = Clock::now();
  const GuestRam& ram = vm.ram();
  if (!ram.host() || ram.shared() || vm.stopped() || max_pages == 0) return r;
  const uint64_t ram_pages = ram.size() / kPage;
  std::vector<uint64_t> priv;
  for (uint64_t at = from_page; at < ram_pages && r.done;) {
    const uint64_t n = std::min(kWindowPages, ram_pages - at);
    for (uint64_t p : PrivatePages(ram.host() + at * kPage, n * kPage)) {
      if (priv.size() == max_pages) {
        r.done = false;
        r.next_page = at + p;
        break;
      }
      priv.push_back(at + p);
    }
    at += n;
  }
  r.private_pages = priv.size();
  if (priv.empty()) {
    r.total_ns = Ns(t0, Clock::now());
    return r;
  }
  SnapshotPages snap(*origin);
  PatternBacking* pattern = vm.pattern();
  if (pattern) {
    std::vector<uint64_t> mapped;
    const uint64_t to = r.done ? ram_pages : r.next_page;
    for (uint64_t at = from_page; at < to && pattern->MapsLeft();) at = MapPattern(vm, *pattern, snap, priv, at, to, r, mapped);
    if (!mapped.empty()) {
      std::sort(mapped.begin(), mapped.end());
      std::vector<uint64_t> rest;
      std::set_difference(priv.begin(), priv.end(), mapped.begin(), mapped.end(), std::back_inserter(rest));
      priv = std::move(rest);
    }
  }

  struct Candidate {
    uint64_t page;
    int64_t copy;  // index into `copies`, -1: the snapshot page is zero
  };
  std::vector<Candidate> cands;
  // Not zero-filled: only the slots used are written (and so backed).
  std::unique_ptr<uint8_t[]> copies(new uint8_t[std::min(priv.size(), kChunkPages) * kPage]);
  for (size_t i = 0; i < priv.size();) {
    // While the guest runs: which private pages equal the snapshot's now.
    cands.clear();
    size_t used = 0;
    for (; i < priv.size() && cands.size() < kChunkPages; i++) {
      const uint8_t* host = ram.host() + priv[i] * kPage;
      uint8_t* buf = copies.get() + used * kPage;
      // What the page falls back to when dropped: the pattern's copy if it is mapped from there.
      const bool from_pattern = pattern && pattern->Has(priv[i]);
      if (from_pattern) pattern->layer().ReadPage(priv[i], buf);
      if (!from_pattern && !snap.Read(priv[i], buf)) {
        if (IsZero(host)) cands.push_back({priv[i], -1});
      } else if (std::memcmp(host, buf, kPage) == 0) {
        cands.push_back({priv[i], int64_t(used++)});
      }
    }
    if (cands.empty()) continue;

    // Held still: compare again, drop the equal ones in runs.
    HeldStill held(vm);
    uint64_t start = 0, len = 0;
    auto flush = [&] {
      if (len && madvise(ram.host() + start * kPage, len * kPage, MADV_DONTNEED) != 0) Fail("madvise(MADV_DONTNEED)");
      r.dropped_pages += len;
      len = 0;
    };
    for (const Candidate& c : cands) {
      const uint8_t* host = ram.host() + c.page * kPage;
      const bool same = c.copy < 0 ? IsZero(host) : std::memcmp(host, copies.get() + c.copy * kPage, kPage) == 0;
      if (!same) {
        flush();
      } else if (len && start + len == c.page) {
        len++;
      } else {
        flush();
        start = c.page;
        len = 1;
      }
    }
    flush();
    AddPause(r, held.Let());
  }
  if (ram.memory().lost()) vm.Fail(vm.RamLostMessage());  // (its reads met a file cut short: ram_guard.h)
  r.total_ns = Ns(t0, Clock::now());
  return r;
}

}  // namespace forkling::vmm::snapshot
