// A prototype for bench/python-floor.ts, not used by the engine: what the
// process engine's children could give back if their parent's memory were a
// file. fr_remap (in the parent, one thread) copies every private writable
// mapping's present, non-zero pages into a memfd and maps that file
// MAP_PRIVATE over the same addresses: the same bytes, now page cache.
// fr_reclaim_and_wait (in a fork, one thread) drops (MADV_DONTNEED) each private page
// that equals the file's: the next read maps the shared page cache page again
// (what the KVM engine's reclaim does with a template's memory file).
// Freestanding, raw system calls: between copying a mapping and mapping the
// file over it nothing may write to it (no libc, not even errno).
//
// What the engine would need on top: every other thread parked during a
// reclaim (a write between the compare and the drop would be lost), the
// mappings smaps marks wipe-on-fork or dont-copy left alone, and the parent's
// own copy-on-write pages (the zygote is remapped before its fork server
// exists, or its pages are held twice).
typedef unsigned long u64;

static long sc(long n, long a, long b, long c, long d, long e, long f) {
  long r;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  register long r9 __asm__("r9") = f;
  __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9) : "rcx", "r11", "memory");
  return r;
}

enum { SYS_read = 0, SYS_write = 1, SYS_open = 2, SYS_close = 3, SYS_mmap = 9, SYS_pread = 17, SYS_pwrite = 18, SYS_madvise = 28,
       SYS_ftruncate = 77, SYS_memfd_create = 319 };
enum { PROT_RW = 3, PROT_R = 1, MAP_SHARED_ = 1, MAP_PRIVATE_ = 2, MAP_FIXED_ = 0x10, MADV_DONTNEED_ = 4 };
#define PAGE 4096UL
#define MAXR 4096

struct region { u64 start, end, off; };
// The caller's memory (an mmap of its own, skipped by fr_remap): the remapped mappings and the file.
struct state { int memfd; int nr; u64 total; const char *shared; struct region r[MAXR]; };

static int is_zero(const char *p) {
  const u64 *q = (const u64 *)p;
  for (int i = 0; i < 512; i++) if (q[i]) return 0;
  return 1;
}

static int same(const char *x, const char *y) {
  const u64 *a = (const u64 *)x, *b = (const u64 *)y;
  for (int i = 0; i < 512; i++) if (a[i] != b[i]) return 0;
  return 1;
}

static u64 hex(const char **s) {
  u64 v = 0;
  for (;;) {
    char c = **s;
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return v;
    v = v * 16 + d;
    (*s)++;
  }
}

static int present(int pagemap, u64 addr, u64 *entry) {
  return sc(SYS_pread, pagemap, (long)entry, 8, (long)(addr / PAGE * 8), 0, 0) == 8;
}

// Returns the bytes copied into the file, or -errno. buf: scratch for /proc/self/maps (skipped too).
long fr_remap(struct state *st, char *buf, long buflen) {
  int fd = sc(SYS_open, (long)"/proc/self/maps", 0, 0, 0, 0, 0);
  if (fd < 0) return fd;
  long n = 0, k;
  while ((k = sc(SYS_read, fd, (long)buf + n, buflen - 1 - n, 0, 0, 0)) > 0) n += k;
  sc(SYS_close, fd, 0, 0, 0, 0, 0);
  buf[n] = 0;
  int pm = sc(SYS_open, (long)"/proc/self/pagemap", 0, 0, 0, 0, 0);
  if (pm < 0) return pm;
  long mfd = sc(SYS_memfd_create, (long)"forkling-floor", 1 /* MFD_CLOEXEC */, 0, 0, 0, 0);
  if (mfd < 0) return mfd;
  st->memfd = mfd;
  st->nr = 0;
  u64 off = 0, copied = 0;
  u64 own[2][2] = {{(u64)st, (u64)st + sizeof *st}, {(u64)buf, (u64)buf + buflen}};
  for (const char *s = buf; *s;) {
    u64 a = hex(&s);
    s++;
    u64 b = hex(&s);
    s++;
    const char *perm = s, *line = s;
    while (*s && *s != '\n') s++;
    const char *path = s;
    while (path > line && path[-1] != ' ') path--;
    if (*s) s++;
    int special = path[0] == '[' && path[1] != 'h';  // [stack], [vvar], [vdso]; [heap] is memory like any
    if (perm[0] != 'r' || perm[1] != 'w' || perm[3] != 'p' || special) continue;
    if ((a < own[0][1] && b > own[0][0]) || (a < own[1][1] && b > own[1][0])) continue;
    if (st->nr == MAXR) break;
    for (u64 p = a; p < b; p += PAGE) {  // present, non-zero pages: the file stays sparse
      u64 e;
      if (!present(pm, p, &e)) return -5;
      if (!(e >> 63 & 1) || is_zero((const char *)p)) continue;
      long w = sc(SYS_pwrite, mfd, (long)p, PAGE, (long)(off + (p - a)), 0, 0);
      if (w != (long)PAGE) return w < 0 ? w : -5;
      copied += PAGE;
    }
    long r = sc(SYS_ftruncate, mfd, (long)(off + (b - a)), 0, 0, 0, 0);
    if (r < 0) return r;
    r = sc(SYS_mmap, (long)a, (long)(b - a), PROT_RW, MAP_PRIVATE_ | MAP_FIXED_, mfd, (long)off);
    if (r != (long)a) return r < 0 ? r : -14;
    st->r[st->nr++] = (struct region){a, b, off};
    off += b - a;
  }
  sc(SYS_close, pm, 0, 0, 0, 0, 0);
  st->total = off;
  long sh = sc(SYS_mmap, 0, (long)off, PROT_R, MAP_SHARED_, mfd, 0);  // the file's bytes, to compare with
  if (sh < 0 && sh > -4096) return sh;
  st->shared = (const char *)sh;
  return (long)copied;
}

// In a fork with no other thread: drops its private pages that equal the
// file's, writes how many (an int) to ready_fd and waits for a byte on
// gate_fd, in here: Python run between the drop and the wait would write
// (and copy) ~280 KiB of its pages again (refcounts, frames, allocations).
// Returns the pages given back, or -errno.
long fr_reclaim_and_wait(struct state *st, int ready_fd, int gate_fd) {
  int pm = sc(SYS_open, (long)"/proc/self/pagemap", 0, 0, 0, 0, 0);
  if (pm < 0) return pm;
  long back = 0;
  for (int i = 0; i < st->nr; i++) {
    const struct region *r = &st->r[i];
    for (u64 p = r->start; p < r->end; p += PAGE) {
      u64 e;
      if (!present(pm, p, &e)) return -5;
      // Only pages of this process alone: not present, the file's page already, or an
      // anonymous page still shared with the parent (and siblings) are not ours to give back.
      if (!(e >> 63 & 1) || (e >> 61 & 1) || !(e >> 56 & 1)) continue;
      if (!same((const char *)p, st->shared + r->off + (p - r->start))) continue;
      if (sc(SYS_madvise, (long)p, PAGE, MADV_DONTNEED_, 0, 0, 0) == 0) back++;
    }
  }
  sc(SYS_close, pm, 0, 0, 0, 0, 0);
  int count = (int)back;
  char c;
  if (sc(SYS_write, ready_fd, (long)&count, sizeof count, 0, 0, 0) != sizeof count) return -5;
  while (sc(SYS_read, gate_fd, (long)&c, 1, 0, 0, 0) == -4) {}  // (EINTR)
  return back;
}
