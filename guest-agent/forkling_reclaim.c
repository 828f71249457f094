/* forkling_reclaim: a template's memory as a file, and forks that give back
 * the pages they copied but hold their template's bytes again.
 *
 * Most pages a fork copies end up byte for byte the template's again (a
 * reference count back where it was). A copied anonymous page cannot be
 * shared again; a copied page of a file mapped MAP_PRIVATE can:
 * MADV_DONTNEED drops the copy and the next access maps the file's page.
 * So fr_remap (in the zygote, before its fork server) copies the pages the
 * process wrote itself into a sealed memfd, densely, and maps that file
 * MAP_PRIVATE over the same addresses (see remap_parked for what stays as it
 * is): the same bytes, shared as page cache. Called again (in the fork
 * server, once it is set up), it makes a second file, a layer over the
 * first, of the pages written since: a fork's copy of one of those then
 * goes back to the fork server's bytes, not the zygote's.
 * fr_reclaim (in a fork, when it is idle) drops each page of its own that
 * equals the bytes of the file it maps there (read from that file's fd,
 * which forks inherit). fr_adopt (in the fork server) takes the template's
 * pattern: the file a fork of it that answered a sandbox's first requests
 * made with fr_remap; a later fork's fr_reclaim maps the pattern's page over
 * each other copy of its own that holds the pattern's bytes for that
 * address (most of what forks write at first, they write alike).
 *
 * Both run with every other thread of the process parked in a signal
 * handler: a write between copying a page and mapping the file over it, or
 * between comparing a page and dropping it, would be lost. A thread that
 * does not park in time (the signal blocked, a thread exiting) makes the
 * call give up, changing nothing.
 *
 * The file is sealed (no write, shrink or grow) before anything maps it:
 * every sandbox of the template maps it, and none may change it for the
 * others. Raw system calls only (no libc, not even errno): nothing here
 * writes memory that is being copied or compared. x86-64 only, as the
 * process engine's seccomp filter.
 */

#define FR_VERSION 5
int fr_version(void) { return FR_VERSION; }

typedef unsigned long u64;
#define PAGE 4096UL
#define FR_MAX_REGIONS 8192
#define MAX_TIDS 1024
#define PARK_SIG 64 /* SIGRTMAX: unused by glibc and CPython */
#define FR_MAX_FILES 4 /* layers: the zygote's, its fork server's (and room) */
/* The most a fork copies ahead (fr_prefault): the host allows its zygote's cgroup this much more
 * per fork (host/engine/process/engine.ts's PREFAULT_MAX_BYTES). */
#define FR_PREFAULT_MAX_PAGES 1024

/* What fr_remap made, in memory of its own (the caller's mmap, which it
 * leaves alone); inherited by forks. */
struct fr_region { u64 start, end, off; };
struct fr_file {
  long fd;      /* read with pread: a mapping of it would count as this process's */
  u64 dev, ino; /* its identity: sandbox code may close fd and open something else there */
};
struct fr_state {
  long nfiles;  /* one per fr_remap that made one, oldest first (and the pattern) */
  struct fr_file f[FR_MAX_FILES];
  long nr;      /* the runs of the last fr_remap (its work space) */
  struct fr_region r[FR_MAX_REGIONS];
  long pfile;   /* the pattern's index in f (fr_adopt), valid while np > 0 */
  long np;      /* its runs: where its pages lay in the process that made it */
  struct fr_region p[FR_MAX_REGIONS];
  /* Pages as runs (off unused). In the pattern child, every page it wrote (written_parked, at its
   * publish); in the fork server and its forks, those of them a fork copies ahead (fr_adopt's
   * mapped_runs: mapped there, at most FR_PREFAULT_MAX_PAGES). */
  long nw;
  struct fr_region w[FR_MAX_REGIONS];
};

long fr_state_size(void) { return sizeof(struct fr_state); }
long fr_files(const struct fr_state *st) { return st->nfiles; }
long fr_fd(const struct fr_state *st, long i) { return i >= 0 && i < st->nfiles ? st->f[i].fd : -1; }
long fr_pattern(const struct fr_state *st) { return st->np > 0 ? st->pfile : -1; }
/* The runs of the last fr_remap: (start, end, file offset) each, fr_nruns of them. */
const struct fr_region *fr_runs(const struct fr_state *st) { return st->r; }
long fr_nruns(const struct fr_state *st) { return st->nr; }
/* In the pattern child, after its publish: the pages it wrote, as runs (start, end, 0), fr_nwritten of them. */
const struct fr_region *fr_written(const struct fr_state *st) { return st->w; }
long fr_nwritten(const struct fr_state *st) { return st->nw; }

/* The index of the file of st with this device and inode, or -1. */
static int file_of(const struct fr_state *st, u64 dev, u64 ino) {
  for (int i = 0; i < st->nfiles; i++)
    if (st->f[i].dev == dev && st->f[i].ino == ino) return i;
  return -1;
}

/* st_dev from the major and minor numbers /proc prints (as glibc's makedev). */
static u64 makedev(u64 major, u64 minor) {
  return (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & ~0xffUL) << 12) | ((major & ~0xfffUL) << 32);
}

#if defined(__x86_64__)

#include "forkling_syscall.h"
#define S0(n) sc(n, 0, 0, 0, 0, 0, 0)
#define S1(n, a) sc(n, (long)(a), 0, 0, 0, 0, 0)
#define S2(n, a, b) sc(n, (long)(a), (long)(b), 0, 0, 0, 0)
#define S3(n, a, b, c) sc(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define S4(n, a, b, c, d) sc(n, (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define S6(n, a, b, c, d, e, f) sc(n, (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f))

enum {
  NR_read = 0, NR_write = 1, NR_open = 2, NR_close = 3, NR_poll = 7, NR_mmap = 9, NR_rt_sigaction = 13, NR_rt_sigprocmask = 14,
  NR_rt_sigreturn = 15, NR_pread = 17, NR_pwrite = 18, NR_madvise = 28, NR_nanosleep = 35, NR_getpid = 39,
  NR_fstat = 5, NR_munmap = 11, NR_msync = 26, NR_exit_group = 231, NR_fcntl = 72, NR_ftruncate = 77, NR_gettid = 186, NR_futex = 202, NR_getdents64 = 217, NR_tgkill = 234,
  NR_memfd_create = 319, NR_openat = 257, NR_process_madvise = 440,
};
#define EINTR 4
#define EBUSY 16
#define ENOSPC 28
#define ETIMEDOUT 110
#define EIO 5
#define ESRCH 3
#define EEXIST 17
#define ENOENT 2
#define ENOMEM 12
#define EBADF 9
#define EPERM 1
#define EINVAL 22

/* ------------------------------------------------------------ parking */

/* In .data, not .bss: the tail of .bss is an anonymous mapping that merges
 * with its neighbour, which fr_remap would then have to leave out whole. */
#define DATA __attribute__((section(".data")))
#define FUTEX_WAIT (0 | 128) /* FUTEX_PRIVATE_FLAG */
#define FUTEX_WAKE (1 | 128)
static volatile int parking DATA; /* 1 while a call wants the others parked */
static volatile int parked DATA;  /* threads in the handler */

/* rt_sigreturn, for SA_RESTORER (the kernel requires one on x86-64). */
void fr_restorer(void);
__asm__(".text\n.align 16\n.globl fr_restorer\n.type fr_restorer, @function\nfr_restorer:\n  mov $15, %rax\n  syscall\n");

static void park_handler(int sig) {
  (void)sig;
  if (!__atomic_load_n(&parking, __ATOMIC_ACQUIRE)) return; /* late: nothing to wait for */
  __atomic_add_fetch(&parked, 1, __ATOMIC_ACQ_REL);
  S3(NR_futex, &parked, FUTEX_WAKE, 1);
  while (__atomic_load_n(&parking, __ATOMIC_ACQUIRE)) S4(NR_futex, &parking, FUTEX_WAIT, 1, 0);
  __atomic_sub_fetch(&parked, 1, __ATOMIC_ACQ_REL);
  S3(NR_futex, &parked, FUTEX_WAKE, 1);
}

struct ksigaction { void (*handler)(int); u64 flags; void (*restorer)(void); u64 mask; };
#define SA_RESTORER 0x04000000
#define SA_RESTART 0x10000000

/* Ours for good (a late signal must never meet the default action, which
 * ends the process); -EEXIST when sandbox code has a handler of its own there. */
static int install_handler(void) {
  struct ksigaction old;
  long r = S4(NR_rt_sigaction, PARK_SIG, 0, &old, 8);
  if (r < 0) return (int)r;
  if (old.handler != 0 /* SIG_DFL */ && old.handler != park_handler) return -EEXIST;
  struct ksigaction sa = {park_handler, SA_RESTORER | SA_RESTART, fr_restorer, ~0UL /* all blocked while parked */};
  return (int)S4(NR_rt_sigaction, PARK_SIG, &sa, 0, 8);
}

static void pause_ms(long ms) {
  long ts[2] = {0, ms * 1000000L};
  S2(NR_nanosleep, ts, 0);
}

static int parse_int(const char *s) {
  int v = 0;
  if (*s < '0' || *s > '9') return -1;
  while (*s >= '0' && *s <= '9') v = v * 10 + (*s++ - '0');
  return *s ? -1 : v;
}

/* Whether the thread named `name` in the directory dirfd (/proc/self/task) has
 * exited (a zombie: the main thread that called pthread_exit stays listed
 * while the others run): it runs no code again, so it needs no parking, and
 * it never would park. */
static int exited(int dirfd, const char *name) {
  char path[40], b[64];
  int k = 0;
  for (; name[k] && k < 20; k++) path[k] = name[k];
  for (const char *t = "/stat"; *t;) path[k++] = *t++;
  path[k] = 0;
  long fd = S4(NR_openat, dirfd, path, 0, 0);
  if (fd < 0) return fd == -ENOENT || fd == -ESRCH;
  long got = S3(NR_read, fd, b, sizeof b);
  S1(NR_close, fd);
  long close_paren = -1; /* (the state follows the last ')': a thread's name may hold one) */
  for (long i = 0; i < got; i++)
    if (b[i] == ')') close_paren = i;
  return close_paren >= 0 && close_paren + 2 < got && (b[close_paren + 2] == 'Z' || b[close_paren + 2] == 'X');
}

/* The process's thread ids other than ours and those that exited, added to tids (no duplicates):
 * -errno, or how many were added. */
static long new_tids(int *tids, long *n, int self) {
  int fd = (int)S3(NR_open, "/proc/self/task", 0x10000 /* O_DIRECTORY */, 0);
  if (fd < 0) return fd;
  char buf[4096];
  long added = 0, got;
  while ((got = S3(NR_getdents64, fd, buf, sizeof buf)) > 0) {
    for (long off = 0; off < got;) {
      unsigned short reclen = *(unsigned short *)(buf + off + 16);
      int tid = parse_int(buf + off + 19);
      off += reclen;
      if (tid <= 0 || tid == self) continue;
      long i = 0;
      while (i < *n && tids[i] != tid) i++;
      if (i < *n || exited(fd, buf + off - reclen + 19)) continue;
      if (*n == MAX_TIDS) {
        S1(NR_close, fd);
        return -ENOSPC;
      }
      tids[(*n)++] = tid;
      added++;
    }
  }
  S1(NR_close, fd);
  return got < 0 ? got : added;
}

static void unpark(void) {
  __atomic_store_n(&parking, 0, __ATOMIC_RELEASE);
  S3(NR_futex, &parking, FUTEX_WAKE, 0x7fffffff);
  for (int i = 0; i < 2000 && __atomic_load_n(&parked, __ATOMIC_ACQUIRE) > 0; i++) pause_ms(1);
}

/* Parks every other thread; 0, or -errno with none parked. `wait_ms` bounds the wait for each round. */
static long park_others(long wait_ms) {
  int tids[MAX_TIDS]; /* (on the stack: the caller's stack is never copied nor compared) */
  long n = 0, r;
  int pid = (int)S0(NR_getpid), self = (int)S0(NR_gettid);
  if ((r = install_handler()) < 0) return r;
  __atomic_store_n(&parked, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&parking, 1, __ATOMIC_RELEASE);
  long signalled = 0;
  for (;;) {
    long before = n;
    if ((r = new_tids(tids, &n, self)) < 0) break;
    if (r == 0 && __atomic_load_n(&parked, __ATOMIC_ACQUIRE) == signalled) return 0; /* all parked, none new */
    for (long i = before; i < n && r >= 0; i++) {
      long k = S3(NR_tgkill, pid, tids[i], PARK_SIG);
      if (k == 0) signalled++;
      else if (k != -ESRCH) r = k; /* (EAGAIN: the queue of pending signals is full) not parked */
    }
    if (r < 0) break;
    long waited = 0;
    while (__atomic_load_n(&parked, __ATOMIC_ACQUIRE) < signalled && waited < wait_ms) {
      pause_ms(1);
      waited++;
    }
    if (__atomic_load_n(&parked, __ATOMIC_ACQUIRE) < signalled) {
      r = -ETIMEDOUT; /* blocked the signal, exited, or stuck in the kernel */
      break;
    }
  }
  unpark();
  return r;
}

/* --------------------------------------------------------- the mappings */

static u64 hex(const char **s) {
  u64 v = 0;
  for (;;) {
    char c = **s;
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return v;
    v = v * 16 + (u64)d;
    (*s)++;
  }
}

static int starts(const char *s, const char *p) {
  while (*p)
    if (*s++ != *p++) return 0;
  return 1;
}

static int is_zero(const char *p) {
  const u64 *q = (const u64 *)p;
  for (int i = 0; i < 512; i++)
    if (q[i]) return 0;
  return 1;
}

static int same_page(const char *x, const char *y) {
  const u64 *a = (const u64 *)x, *b = (const u64 *)y;
  for (int i = 0; i < 512; i++)
    if (a[i] != b[i]) return 0;
  return 1;
}

/* A mapping to make the file's: private, read-write, plain memory; none of
 * ours; not wipe-on-fork, dont-copy, locked, hugetlb, I/O or userfaultfd. */
struct mapping {
  u64 start, end, off; /* off: its file offset */
  int anon, ok, layer; /* layer: a mapping of one of st's files */
  int file;            /* ... its index in st (-1: none) */
  int rwp;             /* readable, writable, private (executable or not) */
};

static int vmflags_ok(const char *f) {
  static const char *const bad[] = {"wf", "dc", "lo", "ht", "io", "pf", "um", "uw", "gd", "sh", "ss", "sl", "mm"};
  for (; *f && *f != '\n'; f++) {
    if (*f == ' ') continue;
    for (unsigned i = 0; i < sizeof bad / sizeof bad[0]; i++)
      if (f[0] == bad[i][0] && f[1] == bad[i][1] && (f[2] == ' ' || f[2] == '\n' || !f[2])) return 0;
    while (f[1] && f[1] != ' ' && f[1] != '\n') f++;
  }
  return 1;
}

/* Reads a /proc file (smaps, maps) into buf, NUL-ended; returns its length or -errno. */
static long read_proc(const char *path, char *buf, long len) {
  int fd = (int)S2(NR_open, path, 0);
  if (fd < 0) return fd;
  long n = 0, k = 0;
  while (n < len - 1 && (k = S3(NR_read, fd, buf + n, len - 1 - n)) > 0) n += k;
  S1(NR_close, fd);
  if (k < 0) return k;
  if (n >= len - 1) return -ENOSPC;
  buf[n] = 0;
  return n;
}

static u64 dec(const char **s) {
  u64 v = 0;
  while (**s >= '0' && **s <= '9') v = v * 10 + (u64)(*(*s)++ - '0');
  return v;
}

/* A line of /proc/<pid>/maps (or the first of a mapping in smaps): its
 * fields, and its name (at the line's end when it has none). */
struct maps_line { u64 start, end; const char *perm, *name; u64 off, dev, ino; };
/* Parses the line at *s and leaves *s at the next one. */
static void maps_line(const char **s, struct maps_line *l) {
  l->start = hex(s);
  (*s)++;
  l->end = hex(s);
  (*s)++;
  l->perm = *s;
  *s += 5;
  l->off = hex(s);
  (*s)++;
  u64 major = hex(s);
  (*s)++;
  u64 minor = hex(s);
  (*s)++;
  l->dev = makedev(major, minor);
  l->ino = dec(s);
  const char *end = *s;
  while (*end && *end != '\n') end++;
  l->name = end;
  while (l->name > l->perm && l->name[-1] != ' ') l->name--;
  *s = *end ? end + 1 : end;
}

/* The next mapping in smaps text at *s (advanced past it); 0 at the end. */
static int next_mapping(const struct fr_state *st, const char **s, struct mapping *m, u64 skip[][2], int nskip) {
  const char *p = *s;
  if (!*p) return 0;
  struct maps_line l;
  maps_line(&p, &l);
  const char *perm = l.perm, *name = l.name;
  m->start = l.start;
  m->end = l.end;
  m->off = l.off;
  m->file = l.ino ? file_of(st, l.dev, l.ino) : -1;
  m->layer = m->file >= 0;
  m->rwp = perm[0] == 'r' && perm[1] == 'w' && perm[3] == 'p';
  m->anon = !*name || *name == '\n' || starts(name, "[heap]") || starts(name, "[anon:");
  /* (not executable: the file is mapped read-write only) */
  m->ok = perm[0] == 'r' && perm[1] == 'w' && perm[2] == '-' && perm[3] == 'p' && (m->anon || m->layer || *name == '/');
  for (int i = 0; i < nskip; i++)
    if (m->start < skip[i][1] && m->end > skip[i][0]) m->ok = 0;
  /* the fields up to the next mapping: VmFlags is the last */
  while (*p) {
    const char *l = p;
    while (*p && *p != '\n') p++;
    if (*p) p++;
    if (starts(l, "ProtectionKey:")) {
      const char *q = l + 14;
      while (*q == ' ') q++;
      if (*q != '0') m->ok = 0; /* (a key may forbid our reads) */
    }
    if (starts(l, "VmFlags:")) {
      if (!vmflags_ok(l + 8)) m->ok = 0;
      break;
    }
  }
  *s = p;
  return 1;
}

/* Pagemap entries for [a, a + n pages): 0 or -errno. */
static long pagemap(int pm, u64 a, u64 *out, long n) {
  long want = n * 8, got = S4(NR_pread, pm, out, want, a / PAGE * 8);
  return got == want ? 0 : got < 0 ? got : -EIO;
}
#define PM_PRESENT (1UL << 63)
#define PM_SWAP (1UL << 62)
#define PM_FILE (1UL << 61)
#define PM_EXCLUSIVE (1UL << 56)

static int in(u64 x, u64 a, u64 b) { return x >= a && x < b; }

/* ------------------------------------------------------------- remap */

static u64 thread_pointer(void) {
  u64 tp;
  __asm__("mov %%fs:0, %0" : "=r"(tp));
  return tp;
}

/* A run of pages to make the file's: [start, end) at file offset off. */
static int add_run(struct fr_state *st, u64 a, u64 b, u64 off) {
  if (st->nr && st->r[st->nr - 1].end == a && st->r[st->nr - 1].off + (a - st->r[st->nr - 1].start) == off) {
    st->r[st->nr - 1].end = b;
    return 0;
  }
  if (st->nr == FR_MAX_REGIONS) return -ENOSPC;
  st->r[st->nr].start = a;
  st->r[st->nr].end = b;
  st->r[st->nr].off = off;
  st->nr++;
  return 0;
}

/* After a failed mmap over a run: if the kernel unmapped (part of) it, the
 * run as anonymous memory again, its bytes read back from the file (all are
 * there); `dropped` (its copies were given back before the mmap: give_back),
 * those bytes written back whether it is still mapped or not. Can this fail
 * too, the process cannot go on: it ends, the others parked. (A refused mmap,
 * ENOMEM at the limit of mappings, unmaps nothing.) */
static void restore_run(long fd, const struct fr_region *g, int dropped) {
  long got = (long)g->start;
  if (S3(NR_msync, g->start, g->end - g->start, 1 /* MS_ASYNC */) != -ENOMEM) { /* still mapped */
    if (!dropped) return;
  } else {
    got = S6(NR_mmap, g->start, g->end - g->start, 3, 0x22 | 0x10 /* PRIVATE | ANONYMOUS | FIXED */, -1, 0);
  }
  for (u64 p = g->start; got == (long)g->start && p < g->end; p += PAGE)
    if (S4(NR_pread, fd, p, PAGE, g->off + (p - g->start)) != (long)PAGE) got = -1;
  if (got != (long)g->start) S1(NR_exit_group, 70);
}

/* The length of the glibc mmapped malloc chunk that starts at page p of an
 * anonymous mapping ending at b (its prev_size word 0, its size word its
 * length with IS_MMAPPED set), or 0. realloc grows such a chunk with mremap:
 * made the file's, it would grow into the file's next bytes, and past its end
 * fault. (A page of other data that looks so is left alone too: harmless.) */
static u64 malloc_chunk_at(u64 p, u64 b) {
  const u64 *w = (const u64 *)p;
  u64 len = w[1] & ~7UL;
  return w[0] == 0 && (w[1] & 7) == 2 && len >= PAGE && len % PAGE == 0 && p + len <= b ? len : 0;
}

/* The process's limit of mappings, less those it has and some room: what runs may add (two each, at most). */
static long runs_allowed(long nmaps) {
  char buf[32];
  long max = 65530, fd = S2(NR_open, "/proc/sys/vm/max_map_count", 0);
  if (fd >= 0) {
    long n = S3(NR_read, fd, buf, sizeof buf - 1);
    S1(NR_close, fd);
    if (n > 0) {
      buf[n] = 0;
      const char *q = buf;
      max = 0;
      while (*q >= '0' && *q <= '9') max = max * 10 + (*q++ - '0');
    }
  }
  long room = (max - nmaps - 1024) / 2;
  return room < 0 ? 0 : room < FR_MAX_REGIONS ? room : FR_MAX_REGIONS;
}

/* With the others parked: copies the pages of this process's own (anonymous:
 * present, or swapped but not a guard page; present ones only if not all
 * zeros) of each mapping to make the file's into a new memfd, densely (the
 * file has no hole: one read through a private mapping, which every fork
 * could make of its fd, would add a page to the file for good), seals it, and
 * maps it over runs of those pages only: untouched memory stays anonymous,
 * and a file's own pages stay that file's (never read here: no file faulted
 * in, nothing past its end), except an earlier fr_remap's file: gaps of up
 * to layer_gap of its pages between pages to copy go into the new file as
 * they are (all inside it). Gaps of a few untouched pages in anonymous memory
 * go into the file as zeros (fewer mappings). glibc's mmapped malloc
 * chunks stay as they are (see malloc_chunk_at). Then reads each page of
 * the runs (a fork that maps one shares it with us: smaps counts a page cache
 * page that one process alone maps as that process's). Returns the bytes
 * written to the file, or -errno with nothing changed; a run whose mapping
 * fails is left (or made again) as it was, and so are those after it.
 * scratch: room for /proc/self/smaps. */
#define GAP 4 /* pages */
/* The fork server's remap joins runs over up to this many pages of the
 * zygote's file: fork() copies the server's mappings one by one, ~2 µs each,
 * for every child. Against 4 pages (measured on an idle 16-core host, numpy
 * template): 635 → 443 mappings in the server, its CPU per fork 1.4-1.6 →
 * 0.9-1.0 ms, 100 forks ready in 193-210 → 154-171 ms; 3.2 MiB more in its
 * file, once per template; idle forks hold the same. */
#define LAYER_GAP 16 /* pages */
#define PM_GUARD (1UL << 58)
static long remap_parked(struct fr_state *st, char *scratch, long scratch_len, u64 layer_gap) {
  long n = read_proc("/proc/thread-self/smaps", scratch, scratch_len);
  if (n < 0) return n;
  u64 ent[512];
  u64 own[3] = {(u64)ent, (u64)&parking, thread_pointer()};
  u64 skip[6][2] = {{(u64)st, (u64)st + sizeof *st}, {(u64)scratch, (u64)scratch + (u64)scratch_len}};
  int nskip = 2;
  long nmaps = 0;
  /* and the mappings of our own stack, this library's data and our thread's TLS */
  struct mapping m;
  const char *s = scratch;
  while (next_mapping(st, &s, &m, skip, 2)) {
    nmaps++;
    for (int i = 0; i < 3; i++) {
      if (in(own[i], m.start, m.end) && nskip < 6) {
        skip[nskip][0] = m.start;
        skip[nskip][1] = m.end;
        nskip++;
        break;
      }
    }
  }
  long allowed = runs_allowed(nmaps);
  int pm = (int)S2(NR_open, "/proc/thread-self/pagemap", 0);
  if (pm < 0) return pm;
  long fd = S2(NR_memfd_create, "forkling-template", 1 | 2 /* MFD_CLOEXEC | MFD_ALLOW_SEALING */);
  if (fd < 0) {
    S1(NR_close, pm);
    return fd;
  }
  long r = 0;
  int full = 0; /* no room for more runs */
  u64 total = 0, written = 0; /* the file's length so far */
  st->nr = 0;
  s = scratch;
  while (r == 0 && next_mapping(st, &s, &m, skip, nskip)) {
    if (!m.ok) continue;
    u64 run = 0, last = 0, roff = 0; /* the current run's start, the end of its last page, its file offset */
    u64 chunk_end = 0;                 /* the end of a malloc chunk being passed over */
    for (u64 a = m.start; a < m.end && r == 0; a += 512 * PAGE) {
      long k = (long)((m.end - a) / PAGE < 512 ? (m.end - a) / PAGE : 512);
      if ((r = pagemap(pm, a, ent, k)) < 0) break;
      for (long i = 0; i < k && r == 0; i++) {
        u64 p = a + (u64)i * PAGE, e = ent[i];
        int readable = !(e & PM_FILE) && !(e & PM_GUARD) && (e & (PM_PRESENT | PM_SWAP)); /* (a swapped page swaps in) */
        if (p >= chunk_end && m.anon && readable) {
          u64 len = malloc_chunk_at(p, m.end);
          if (len) chunk_end = p + len;
        }
        if (p < chunk_end || (e & PM_GUARD)) { /* left as it is: ends the run (a guard page in a gap would fault) */
          if (last && (r = add_run(st, run, last, roff)) < 0) break;
          last = 0;
          continue;
        }
        if (!readable) continue;
        if ((e & PM_PRESENT) && is_zero((const char *)p)) continue; /* (a swapped page: not read here) */
        /* (an earlier file's pages in a gap: its bytes, all inside it, copied as they are) */
        int joins = last && p - last <= (m.layer ? layer_gap : GAP) * PAGE && (m.anon || m.layer || p == last);
        if (!joins) {
          if (last && (r = add_run(st, run, last, roff)) < 0) break;
          if (st->nr >= allowed) {
            full = 1;
            break;
          }
          run = last = p;
          roff = total;
        }
        /* (the gap's pages: zeros, or untouched, which read as zeros) then this page; the kernel
         * reads them: one it cannot read (EFAULT, or a short write) ends the run before the gap,
         * and this page is tried again as a run of its own */
        long w = S4(NR_pwrite, fd, last, p + PAGE - last, roff + (last - run));
        if (w != (long)(p + PAGE - last)) {
          if (w < 0 && w != -14 /* EFAULT */) {
            r = w;
            break;
          }
          int alone = last == p; /* (the short bytes lie past `total`: overwritten or cut off) */
          if (last > run && (r = add_run(st, run, last, roff)) < 0) break;
          last = 0;
          if (!alone) i--;
          continue;
        }
        written += p + PAGE - last;
        last = p + PAGE;
        total = roff + (last - run);
      }
    }
    if (r == 0 && last) r = add_run(st, run, last, roff);
  }
  S1(NR_close, pm);
  if (r == -ENOSPC) full = 1; /* (the table of runs is full) */
  if (full) r = 0; /* (runs past the room left stay as they were) */
  if (r == 0 && st->nr == 0) r = -ENOENT;
  /* F_ADD_SEALS: SEAL | SHRINK | GROW | WRITE */
  if (r == 0) r = S2(NR_ftruncate, fd, total);
  if (r == 0) r = S3(NR_fcntl, fd, 1033, 1 | 2 | 4 | 8);
  u64 stat[18];
  if (r == 0) r = S2(NR_fstat, fd, stat);
  if (r < 0) {
    S1(NR_close, fd);
    st->nr = 0;
    return r;
  }
  for (long i = 0; i < st->nr; i++) {
    const struct fr_region *g = &st->r[i];
    long got = S6(NR_mmap, g->start, g->end - g->start, 3 /* READ | WRITE */, 2 | 0x10 /* PRIVATE | FIXED */, fd, g->off);
    if (got != (long)g->start) {
      restore_run(fd, g, 0);
      st->nr = i;
      break;
    }
    for (u64 p = g->start; p < g->end; p += PAGE) (void)*(volatile const char *)p;
  }
  if (st->nr == 0) {
    S1(NR_close, fd);
    return -ENOMEM;
  }
  st->f[st->nfiles].fd = fd;
  st->f[st->nfiles].dev = stat[0];
  st->f[st->nfiles].ino = stat[1];
  st->nfiles++;
  return (long)written;
}

static long reclaim_parked(const struct fr_state *st);
static long publish_parked(struct fr_state *st);
enum { DO_REMAP, DO_RECLAIM, DO_PUBLISH };

/* Does `what` with every other thread parked, or gives up (-ETIMEDOUT,
 * -EEXIST, ...) changing nothing. */
static long run_parked(int what, struct fr_state *st, char *scratch, long scratch_len, long wait_ms) {
  u64 all = ~0UL, old;
  S4(NR_rt_sigprocmask, 2 /* SIG_SETMASK */, &all, &old, 8); /* no handler of ours runs in between */
  long r = park_others(wait_ms);
  if (r == 0) {
    r = what == DO_REMAP ? remap_parked(st, scratch, scratch_len, LAYER_GAP) : what == DO_RECLAIM ? reclaim_parked(st) : publish_parked(st);
    unpark();
  }
  S4(NR_rt_sigprocmask, 2, &old, 0, 8);
  return r;
}

long fr_remap(struct fr_state *st, char *scratch, long scratch_len, long wait_ms) {
  if (st->nfiles == FR_MAX_FILES) return -ENOSPC;
  return run_parked(DO_REMAP, st, scratch, scratch_len, wait_ms);
}

/* ----------------------------------------------------------- pattern */

/* Adds page p to st->w, to its last run where p follows it; 0 when full. */
static int add_written(struct fr_state *st, u64 p) {
  struct fr_region *w = st->nw ? &st->w[st->nw - 1] : 0;
  if (w && w->end == p) {
    w->end += PAGE;
  } else if (st->nw < FR_MAX_REGIONS) {
    st->w[st->nw].start = p;
    st->w[st->nw].end = p + PAGE;
    st->w[st->nw].off = 0;
    st->nw++;
  } else {
    return 0;
  }
  return 1;
}

/* Of the pages the pattern child wrote (`written`, n runs, checked), those
 * that lie here in a mapping remap would take (read-write, private, no flag
 * that forbids our reads) and are no guard page, as runs in st->w: what a
 * fork of this process writes at its first requests, which fr_prefault
 * copies ahead (the first FR_PREFAULT_MAX_PAGES of them). A fork populates
 * nothing else. Returns how many pages that is. */
static long mapped_runs(struct fr_state *st, const struct fr_region *runs, long nruns, const struct fr_region *written, long n) {
  st->nw = 0;
  long pages = 0;
  const long len = 32 << 20;
  long buf = S6(NR_mmap, 0, len, 3, 0x22 /* PRIVATE | ANONYMOUS */, -1, 0);
  if (buf < 0 && buf > -4096) return 0;
  /* Not the memory of this call and its caller, mapped since the pattern child was forked, maybe
   * where it had its threads' stacks (a fork would copy there what it maps then, if anything). */
  u64 skip[4][2] = {{(u64)st, (u64)st + sizeof *st}, {(u64)buf, (u64)buf + (u64)len},
                    {(u64)runs, (u64)(runs + nruns)}, {(u64)written, (u64)(written + n)}};
  char *smaps = (char *)buf;
  int pm = (int)S2(NR_open, "/proc/thread-self/pagemap", 0);
  struct mapping m;
  u64 ent;
  long i = 0;
  if (pm >= 0 && read_proc("/proc/thread-self/smaps", smaps, len) > 0) {
    for (const char *s = smaps; i < n && st->nw < FR_MAX_REGIONS && next_mapping(st, &s, &m, skip, 4);) {
      for (; i < n && written[i].end <= m.start; i++) {}
      for (long j = i; m.ok && j < n && written[j].start < m.end; j++) {
        u64 a = written[j].start > m.start ? written[j].start : m.start, b = written[j].end < m.end ? written[j].end : m.end;
        for (u64 q = a; q < b && pages < FR_PREFAULT_MAX_PAGES; q += PAGE) {
          if (pagemap(pm, q, &ent, 1) < 0 || (ent & PM_GUARD)) continue;
          pages += add_written(st, q);
        }
      }
    }
  }
  if (pm >= 0) S1(NR_close, pm);
  S2(NR_munmap, buf, len);
  return pages;
}

/* Of the pages forks copy ahead (st->w), unmaps here those that are a file's own page (present,
 * not copied: our template files', mapped private): only the page table entry goes, the bytes are
 * the file's here and in every fork. Then fork() copies no entry for them, and a fork's
 * MADV_POPULATE_WRITE copies each from the file into an empty entry, not over a read-only one
 * whose TLB entry it must flush first: one flush per page, a hypercall each on a host that is
 * itself a VM without nested paging. (Fork of 10 on such a host, alternated runs: median 175 -> 164
 * ms; host/engine/process/README.md, "Copying ahead".) */
static void unmap_clean(const struct fr_state *st) {
  int pm = (int)S2(NR_open, "/proc/thread-self/pagemap", 0);
  if (pm < 0) return;
  u64 ent[64];
  for (long i = 0; i < st->nw; i++) {
    for (u64 a = st->w[i].start; a < st->w[i].end;) {
      long k = (long)((st->w[i].end - a) / PAGE);
      if (k > 64) k = 64;
      if (pagemap(pm, a, ent, k) < 0) break;
      for (long j = 0; j < k;) {
        long e = j;
        while (e < k && (ent[e] & (PM_PRESENT | PM_FILE)) == (PM_PRESENT | PM_FILE)) e++;
        if (e > j) S3(NR_madvise, a + (u64)j * PAGE, (u64)(e - j) * PAGE, 4 /* MADV_DONTNEED */);
        j = e + 1;
      }
      a += (u64)k * PAGE;
    }
  }
  S1(NR_close, pm);
}

/* Whether runs are page-aligned, in order, not overlapping, not empty and below 2^56 (and, with
 * in_file, each inside a file of `size` bytes at its offset). */
static int runs_ok(const struct fr_region *runs, long n, int in_file, u64 size) {
  u64 prev = 0;
  for (long i = 0; i < n; i++) {
    const struct fr_region *g = &runs[i];
    if (g->start % PAGE || g->end % PAGE || g->off % PAGE || g->start < prev || g->end <= g->start || g->end > (1UL << 56))
      return 0;
    if (in_file && (g->off > size || g->end - g->start > size - g->off)) return 0;
    prev = g->end;
  }
  return 1;
}

/* In the fork server: takes the pattern, the file a pattern child of the
 * template made with fr_remap (fd: the fork server's own fd of it) after it
 * had answered what every sandbox answers first, and its runs (where those
 * pages lay in it; from that child, so checked here). A fork of the server
 * lays its pages out as the pattern child did, and most of what it writes
 * at first it writes as the pattern child did, byte for byte: fr_reclaim
 * then maps the pattern's page over such a copy. `written` (nwritten runs,
 * offsets unused) are the pages the pattern child wrote (fr_written): those
 * of them mapped here, each fork copies ahead (mapped_runs, fr_prefault).
 * Forks inherit it. Returns the file's length (and in *prefault_pages,
 * unless 0, the pages each fork copies ahead), or -errno with nothing
 * changed. */
long fr_adopt(struct fr_state *st, long fd, const struct fr_region *runs, long n, const struct fr_region *written,
              long nwritten, long *prefault_pages) {
  u64 stat[18];
  if (st->np) return -EEXIST;
  if (st->nfiles == FR_MAX_FILES) return -ENOSPC;
  if (n < 1 || n > FR_MAX_REGIONS || nwritten < 0 || nwritten > FR_MAX_REGIONS) return -EINVAL;
  if (!runs_ok(written, nwritten, 0, 0)) return -EINVAL;
  if (S2(NR_fstat, fd, stat) < 0) return -EBADF;
  /* sealed against writes and changes of length: what a fork compared is what it maps, for good */
  long seals = S2(NR_fcntl, fd, 1034 /* F_GET_SEALS */);
  if (seals < 0 || (seals & 15) != 15 /* SEAL | SHRINK | GROW | WRITE */) return -EPERM;
  u64 size = stat[6];
  if (!runs_ok(runs, n, 1, size)) return -EINVAL;
  /* Mapped here too, read-only, private (no shared mapping for a fork to
   * take over: forkling_inherit), not inherited, every page read: a pattern
   * page that one fork alone maps is then still the server's too (smaps
   * counts it shared, as the template's files: one copy for all forks). */
  long a = S6(NR_mmap, 0, size, 1 /* READ */, 2 /* PRIVATE */, fd, 0);
  if (a < 0 && a > -4096) return a;
  S3(NR_madvise, a, size, 10 /* MADV_DONTFORK */);
  for (u64 q = 0; q < size; q += PAGE) (void)*(volatile const char *)(a + q);
  for (long i = 0; i < n; i++) st->p[i] = runs[i];
  st->pfile = st->nfiles;
  st->f[st->nfiles].fd = fd;
  st->f[st->nfiles].dev = stat[0];
  st->f[st->nfiles].ino = stat[1];
  st->nfiles++;
  st->np = n;
  long pages = mapped_runs(st, runs, n, written, nwritten);
  /* a kernel without MADV_POPULATE_WRITE (before 5.14): nothing to copy ahead (st: ours, written) */
  if (st->nw && S3(NR_madvise, (u64)st & ~(PAGE - 1), PAGE, 23) == -EINVAL) st->nw = pages = 0;
  unmap_clean(st);
  if (prefault_pages) *prefault_pages = pages;
  return (long)size;
}

/* In a new fork, first thing (the fork server's child, one thread, no
 * Python run yet): copies the pages the template's pattern child wrote
 * (mapped_runs), which a fork writes at its first requests too, one
 * madvise(MADV_POPULATE_WRITE) per run, instead of one write fault each
 * later. A fault costs an exception and, once the fork runs its threads, a
 * TLB flush on the other cores that run them: on a host that is itself a VM
 * without nested paging, each of those is a hypercall. A run that fails (not
 * mapped here any more) fails alone. Copies of the template's bytes that
 * the fork never changes go back at its first reclaim. Returns the pages
 * copied, or -EINVAL where the kernel has no MADV_POPULATE_WRITE (before
 * 5.14). */
long fr_prefault(const struct fr_state *st) {
  long n = 0;
  for (long i = 0; i < st->nw; i++) {
    const struct fr_region *g = &st->w[i];
    long r = S3(NR_madvise, g->start, g->end - g->start, 23 /* MADV_POPULATE_WRITE */);
    if (r == -EINVAL) return r;
    if (r == 0) n += (long)((g->end - g->start) / PAGE);
  }
  return n;
}

/* The pattern's run that holds address a, or 0 (fr_adopt checked they are in order). */
static const struct fr_region *pattern_run(const struct fr_state *st, u64 a) {
  long lo = 0, hi = st->np;
  while (lo < hi) {
    long mid = (lo + hi) / 2;
    if (st->p[mid].end <= a) lo = mid + 1;
    else hi = mid;
  }
  return lo < st->np && st->p[lo].start <= a ? &st->p[lo] : 0;
}

/* Maps the pattern over the pages of g (each equal to the pattern's bytes
 * there; their copies may have been given back already: give_back) and
 * empties g; returns the pages now the pattern's. After a failed mmap they
 * hold those bytes again (restore_run). */
static long map_pattern(const struct fr_state *st, struct fr_region *g) {
  long fd = st->f[st->pfile].fd, n = (long)((g->end - g->start) / PAGE);
  long got = S6(NR_mmap, g->start, g->end - g->start, 3 /* READ | WRITE */, 2 | 0x10 /* PRIVATE | FIXED */, fd, g->off);
  if (got != (long)g->start) {
    restore_run(fd, g, 1);
    n = 0;
  }
  g->start = g->end = g->off = 0;
  return n;
}

/* ----------------------------------------------------------- reclaim */

/* Drops the pages of g (each equal to its file's bytes) in one call, and
 * empties g; returns the pages dropped. One call per run, not per page:
 * each call flushes the TLB, which costs most where the host is itself a
 * VM without nested paging (a hypercall per flush). */
static long drop_run(struct fr_region *g) {
  long n = (long)((g->end - g->start) / PAGE);
  if (n && S3(NR_madvise, g->start, g->end - g->start, 4 /* MADV_DONTNEED */) != 0) n = 0;
  g->start = g->end = g->off = 0;
  return n;
}

/* A reclaim's runs, given back together (give_back): one process_madvise
 * (MADV_DONTNEED) for all of them flushes the TLB once (Linux 6.16 and
 * later), where a madvise or an mmap over present pages per run flushed once
 * each; the pattern's mmaps then replace no present entry and flush nothing.
 * Where the host is itself a VM without nested paging every flush is a trip
 * to the hypervisor. Kept in the scratch mapping, not on the stack (whose
 * pages an idle fork would keep). */
#define BATCH_RUNS 256
#define PIDFD_SELF (-10000) /* (Linux 6.15; before, EBADF: a run at a time) */
struct batch {
  long nd, np;                                   /* runs to drop, runs to map the pattern over */
  struct fr_region d[BATCH_RUNS], p[BATCH_RUNS];
  u64 iov[2 * BATCH_RUNS][2];                    /* struct iovec: base, length */
};

/* Gives back the runs of b and empties it; returns the pages given back.
 * The pattern's runs first: a drop run the kernel refuses (a locked mapping,
 * say) ends the call there, and those after it are dropped a run at a time.
 * A pattern run's pages are dropped before its mmap, so a refused mmap must
 * write them back (restore_run), taking memory again; one that cannot (its
 * cgroup full meanwhile) ends the process, as before when the kernel had
 * unmapped the run. */
static long give_back(const struct fr_state *st, struct batch *b) {
  long n = 0, bytes = 0, back = 0;
  for (long i = 0; i < b->nd + b->np; i++) {
    const struct fr_region *g = i < b->np ? &b->p[i] : &b->d[i - b->np];
    b->iov[n][0] = g->start;
    b->iov[n][1] = g->end - g->start;
    bytes += (long)(g->end - g->start);
    n++;
  }
  /* (refused by an older kernel, or done in part: each drop again on its own; a
   * pattern's page dropped or not, map_pattern writes its bytes back if its mmap fails) */
  int all = n > 0 && S6(NR_process_madvise, PIDFD_SELF, b->iov, n, 4 /* MADV_DONTNEED */, 0, 0) == bytes;
  for (long i = 0; i < b->nd; i++) {
    if (!all) back += drop_run(&b->d[i]);
    else back += (long)((b->d[i].end - b->d[i].start) / PAGE);
  }
  for (long i = 0; i < b->np; i++) back += map_pattern(st, &b->p[i]);
  b->nd = b->np = 0;
  return back;
}

/* Adds the run g to b's list l (nl runs so far) and empties g; b full: given back first. */
static long queue_run(const struct fr_state *st, struct batch *b, struct fr_region *l, long *nl, struct fr_region *g) {
  long back = 0;
  if (!g->end) return 0;
  if (*nl == BATCH_RUNS) back = give_back(st, b);
  l[(*nl)++] = *g;
  g->start = g->end = g->off = 0;
  return back;
}

/* With the others parked: drops each page of this process alone (present,
 * anonymous, exclusive, not all zeros) in its private mappings of the files
 * (found again in /proc/self/smaps: memory unmapped and mapped anew since a
 * remap is not a file's) whose bytes equal that file's at that offset; and
 * maps the pattern (fr_adopt) over each other such page whose bytes equal
 * the pattern's for that address (runs of them in one mmap each, as many as
 * the limit of mappings leaves room for: each may split a mapping in three),
 * where the mapping is one fr_remap would take (read-write, not executable,
 * no flag or key the new mapping would lose: sandbox code may have changed
 * them since). Skips the mappings of the caller's stack and TLS. Returns the
 * pages given back, or -errno. */
static long reclaim_parked(const struct fr_state *st) {
  u64 ent[512], page[512], stat[18];
  u64 me = (u64)ent, tp = thread_pointer();
  for (long i = 0; i < st->nfiles; i++)
    if (S2(NR_fstat, st->f[i].fd, stat) < 0 || stat[0] != st->f[i].dev || stat[1] != st->f[i].ino) return -EBADF;
  const long len = 32 << 20; /* (touched as far as smaps goes, and the batch at its end) */
  long buf = S6(NR_mmap, 0, len, 3, 0x22 /* PRIVATE | ANONYMOUS */, -1, 0);
  if (buf < 0 && buf > -4096) return buf;
  char *smaps = (char *)buf;
  struct batch *bt = (struct batch *)(buf + len - (long)sizeof(struct batch));
  long back = 0, r = read_proc("/proc/thread-self/smaps", smaps, len - (long)sizeof(struct batch));
  long nmaps = 0;
  struct mapping m;
  for (const char *q = smaps; r > 0 && next_mapping(st, &q, &m, 0, 0);) nmaps++;
  long left = st->np > 0 ? runs_allowed(nmaps) : 0; /* pattern mmaps this call may make */
  struct fr_region pend = {0, 0, 0};                /* pages to map the pattern over, not yet mapped */
  struct fr_region drop = {0, 0, 0};                /* pages equal to their file's, not yet dropped */
  if (r > 0) r = 0;
  int pm = r == 0 ? (int)S2(NR_open, "/proc/thread-self/pagemap", 0) : -1;
  if (r == 0 && pm < 0) r = pm;
  for (const char *s = smaps; r == 0 && next_mapping(st, &s, &m, 0, 0);) {
    u64 a = m.start, b = m.end;
    int k = m.file;
    if (k < 0 || !m.rwp) continue;
    if (in(me, a, b) || in(tp, a, b)) continue;
    for (u64 c = a; c < b && r == 0; c += 512 * PAGE) {
      long cnt = (long)((b - c) / PAGE < 512 ? (b - c) / PAGE : 512);
      if ((r = pagemap(pm, c, ent, cnt)) < 0) break;
      for (long j = 0; j < cnt; j++) {
        if ((ent[j] & (PM_PRESENT | PM_FILE | PM_EXCLUSIVE)) != (PM_PRESENT | PM_EXCLUSIVE)) continue;
        const char *p = (const char *)(c + (u64)j * PAGE);
        if (is_zero(p)) continue; /* (dropped, it would read the file's hole: a page added to the file) */
        if (S4(NR_pread, st->f[k].fd, page, PAGE, m.off + ((u64)p - a)) != (long)PAGE) continue;
        if (same_page(p, (const char *)page)) {
          if (drop.end != (u64)p) back += queue_run(st, bt, bt->d, &bt->nd, &drop);
          if (!drop.end) drop.start = (u64)p;
          drop.end = (u64)p + PAGE;
          continue;
        }
        const struct fr_region *g = left > 0 && m.ok && k != st->pfile ? pattern_run(st, (u64)p) : 0;
        if (!g) continue;
        u64 off = g->off + ((u64)p - g->start);
        if (S4(NR_pread, st->f[st->pfile].fd, page, PAGE, off) != (long)PAGE || !same_page(p, (const char *)page)) continue;
        if (pend.end == (u64)p && pend.off + (pend.end - pend.start) == off) {
          pend.end += PAGE;
          continue;
        }
        if (pend.end) {
          back += queue_run(st, bt, bt->p, &bt->np, &pend);
          if (--left == 0) continue;
        }
        pend.start = (u64)p;
        pend.end = (u64)p + PAGE;
        pend.off = off;
      }
    }
    if (pend.end) { /* (before the next mapping, which may be another file's) */
      back += queue_run(st, bt, bt->p, &bt->np, &pend);
      left--;
    }
    back += queue_run(st, bt, bt->d, &bt->nd, &drop);
  }
  back += give_back(st, bt); /* (after a failure too: each run queued was checked) */
  if (pm >= 0) S1(NR_close, pm);
  S2(NR_munmap, buf, len);
  return r < 0 ? r : back;
}

long fr_reclaim(const struct fr_state *st, long wait_ms) {
  if (!st->nfiles) return 0;
  return run_parked(DO_RECLAIM, (struct fr_state *)st, 0, 0, wait_ms); /* (reclaim_parked writes nothing in st) */
}

/* With the others parked, in the pattern child: the pages it wrote (its
 * own copies, present and exclusive, not a file's page) in the mappings
 * remap would take, but for st and the scratch, as runs in st->w: before
 * its reclaim gives back those equal to the files again, which a fork
 * writes too (a reference count up and down again). */
static void written_parked(struct fr_state *st, char *scratch, long scratch_len) {
  u64 ent[512];
  u64 skip[2][2] = {{(u64)st, (u64)st + sizeof *st}, {(u64)scratch, (u64)scratch + (u64)scratch_len}};
  st->nw = 0;
  int pm = (int)S2(NR_open, "/proc/thread-self/pagemap", 0);
  if (pm < 0 || read_proc("/proc/thread-self/smaps", scratch, scratch_len) <= 0) {
    if (pm >= 0) S1(NR_close, pm);
    return;
  }
  struct mapping m;
  for (const char *s = scratch; st->nw < FR_MAX_REGIONS && next_mapping(st, &s, &m, skip, 2);) {
    if (!m.ok) continue;
    for (u64 c = m.start; c < m.end; c += 512 * PAGE) {
      long cnt = (long)((m.end - c) / PAGE < 512 ? (m.end - c) / PAGE : 512);
      if (pagemap(pm, c, ent, cnt) < 0) break;
      for (long j = 0; j < cnt; j++) {
        if ((ent[j] & (PM_PRESENT | PM_FILE | PM_EXCLUSIVE)) != (PM_PRESENT | PM_EXCLUSIVE)) continue;
        add_written(st, c + (u64)j * PAGE);
      }
    }
  }
  S1(NR_close, pm);
}

/* The pattern child's publish (publish != 0): notes the pages it wrote
 * (written_parked), gives back its pages equal to the files, then makes
 * the rest a file of its own, a layer (as fr_remap: its fd and runs are
 * then the last in st), all in one park. */
static long publish_parked(struct fr_state *st) {
  if (st->nfiles == FR_MAX_FILES) return -ENOSPC; /* (checked parked: nothing else changes nfiles meanwhile) */
  const long len = 32 << 20;
  long buf = S6(NR_mmap, 0, len, 3, 0x22 /* PRIVATE | ANONYMOUS */, -1, 0);
  if (buf < 0 && buf > -4096) return buf;
  written_parked(st, (char *)buf, len);
  reclaim_parked(st); /* (a failure leaves more pages for the pattern: no harm) */
  long r = remap_parked(st, (char *)buf, len, GAP); /* (every fork compares its pages with this layer: no more than it wrote) */
  S2(NR_munmap, buf, len);
  return r;
}

/* An idle fork's reclaim (the pattern child's publish), then, if it did not
 * fail, poll(2) on fds (struct pollfd[nfds]) with no timeout, in the same
 * call: the thread writes no page between giving its copies back and its
 * sleep (a return to Python in between would copy a good part of them
 * again). The pattern child publishes through this same call, so its
 * memory is laid out as a fork's is when that one reclaims (Python's
 * allocator pools, reference counts of what the caller holds). The caller
 * sees what woke it in its own poll after (fds are level-triggered).
 * Returns what fr_reclaim (or fr_remap) returned. */
long fr_reclaim_wait(struct fr_state *st, long wait_ms, void *fds, long nfds, long publish) {
  long r = !publish ? fr_reclaim(st, wait_ms) : st->nfiles ? run_parked(DO_PUBLISH, st, 0, 0, wait_ms) : -ENOENT;
  if (r >= 0 && nfds > 0) S3(NR_poll, fds, nfds, -1); /* (EINTR, a signal: back to the caller, which decides again) */
  return r;
}

#else /* not x86-64 */

long fr_remap(struct fr_state *st, char *scratch, long scratch_len, long wait_ms) {
  (void)st, (void)scratch, (void)scratch_len, (void)wait_ms;
  return -38; /* ENOSYS */
}
long fr_reclaim(const struct fr_state *st, long wait_ms) {
  (void)st, (void)wait_ms;
  return -38;
}
long fr_prefault(const struct fr_state *st) {
  (void)st;
  return -22; /* EINVAL */
}
long fr_adopt(struct fr_state *st, long fd, const struct fr_region *runs, long n, const struct fr_region *written,
              long nwritten, long *prefault_pages) {
  (void)st, (void)fd, (void)runs, (void)n, (void)written, (void)nwritten, (void)prefault_pages;
  return -38;
}
long fr_reclaim_wait(struct fr_state *st, long wait_ms, void *fds, long nfds, long publish) {
  (void)st, (void)wait_ms, (void)fds, (void)nfds, (void)publish;
  return -38;
}

#endif
