/* forkling_spawn: the process engine's fork loop and child set-up, in C.
 *
 * The fork server (forkling_zygote.py) forks every child of a template. Run
 * as Python, the loop between two forks and each child's namespace and mount
 * set-up write Python objects (reference counts, ctypes' argument objects),
 * and every page written is one more page copied into that child. Here the
 * loop and the set-up are system calls only: the fork server spends half the
 * CPU per child, and each child ends up with 60-100 KiB fewer private pages
 * (not the ~330 KiB its set-up wrote in Python: the agent writes most of
 * those pages again later).
 *
 * Freestanding: no libc is linked. The caller passes the libc functions it
 * needs (glibc's own fork() keeps its thread-id cache and at-fork state
 * right), so the library loads into any image whatever its libc version.
 */

/* Checked by the caller against its own copy of the structures below. */
#define FS_VERSION 4
int fs_version(void) { return FS_VERSION; }

/* Every function called returns an int (pid_t, or 0 / -1): read as a long,
 * the upper half of the register would be whatever the callee left there. */
typedef int (*fn_t)(long, long, long, long, long, long);

struct timespec_ { long sec, nsec; };

/* The libc functions, filled in by the caller (ctypes addresses). */
struct fs_libc {
  fn_t fork, unshare, setns, pipe2, close, socket, ioctl, clock_gettime;
  int *(*errno_location)(void);
};

/* One set-up step: fn(args...), failed when it returns < 0 (errno says why). */
enum { STEP_CALL = 0, STEP_HOSTNAME = 1, STEP_LO_UP = 2, STEP_KEEP_FD = 3 };
struct fs_step {
  long kind; /* STEP_HOSTNAME: sethostname(child's name) with fn; STEP_KEEP_FD: fn's result is the child's keep_fd */
  fn_t fn;
  long args[5];
};

/* What failed in the parent (fs_child.failed_call). */
enum { CALL_NONE = 0, CALL_PIPE2 = 1, CALL_UNSHARE = 2, CALL_FORK = 3, CALL_SETNS = 4 };

struct fs_child {
  const char *hostname;
  long hostname_len;
  long start_ns;    /* out: CLOCK_MONOTONIC when its fork began */
  int pid;          /* out: in the parent, the child's pid (0: not forked) */
  int ready_r;      /* out: in the parent, the read end of its ready pipe */
  int ready_w;      /* out: in the child, the write end */
  int keep_fd;      /* out: in the child, what its STEP_KEEP_FD step returned */
  int step_failed;  /* out: in a child, the step that failed (-1: none) */
  int failed_call;  /* out: in the parent, CALL_* that failed for this child */
  int err;          /* out: the errno of either */
  int flags;        /* FS_PATTERN: the template's pattern child (forkling_zygote._make_pattern) */
  const char *id;   /* its sandbox id (fs_serve: NUL-ended) */
};
#define FS_PATTERN 1

/* fs_serve's arguments, and what it tells a child. */
struct fs_serve {
  int sock;     /* the fork server's socket to its zygote */
  int pidns_fd; /* the fork server's own pid namespace */
  const struct fs_step *steps;
  long nsteps;
  long ready_timeout_ms; /* how long a child may take to say it is ready */
  long reap_ms;          /* how often an idle server reaps its exited children */
  /* forkling_reclaim's fr_adopt and its state, or 0: the pattern's file (fs_serve's adopt) */
  long (*adopt)(void *st, long fd, const void *runs, long n, const void *written, long nw, long *prefault_pages);
  /* forkling_reclaim's fr_prefault, or 0: run in each new child, first thing */
  long (*prefault)(const void *st);
  void *st;
  /* out, in a child: what it is (fs_serve has unmapped its copy of the request) */
  long index;
  int flags, ready_w, keep_fd, step_failed, err, pad_;
  char id[40];
  char hostname[72];
};

/* sizeof of each structure, for the caller's check of its copies. */
void fs_sizes(long out[4]) {
  out[0] = sizeof(struct fs_libc);
  out[1] = sizeof(struct fs_step);
  out[2] = sizeof(struct fs_child);
  out[3] = sizeof(struct fs_serve);
}

#define CLONE_NEWPID 0x20000000
#define CLOCK_MONOTONIC 1
#define O_CLOEXEC 02000000

#define AF_INET 2
#define SOCK_DGRAM 2
#define SOCK_CLOEXEC 02000000
#define SIOCGIFFLAGS 0x8913
#define SIOCSIFFLAGS 0x8914

/* `lo` up in the child's new network namespace (struct ifreq: name, then flags). */
static int lo_up(const struct fs_libc *c) {
  union {
    char bytes[40];
    struct { char name[16]; short flags; } f;
  } req;
  for (int i = 0; i < 40; i++) req.bytes[i] = 0;
  req.f.name[0] = 'l';
  req.f.name[1] = 'o';
  int fd = c->socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0, 0, 0, 0);
  if (fd < 0) return -1;
  int rc = c->ioctl(fd, SIOCGIFFLAGS, (long)&req, 0, 0, 0);
  if (rc >= 0) {
    req.f.flags |= 1; /* IFF_UP */
    rc = c->ioctl(fd, SIOCSIFFLAGS, (long)&req, 0, 0, 0);
  }
  int err = *c->errno_location();
  c->close(fd, 0, 0, 0, 0, 0);
  *c->errno_location() = err;
  return rc;
}

/* Runs steps[0..n) in the child; returns the index of a failed step or -1. */
static int run_steps(const struct fs_libc *c, const struct fs_step *steps, int n, struct fs_child *ch) {
  for (int i = 0; i < n; i++) {
    const struct fs_step *s = &steps[i];
    int rc;
    if (s->kind == STEP_HOSTNAME) {
      rc = s->fn((long)ch->hostname, ch->hostname_len, 0, 0, 0, 0);
    } else if (s->kind == STEP_LO_UP) {
      rc = lo_up(c);
    } else {
      rc = s->fn(s->args[0], s->args[1], s->args[2], s->args[3], s->args[4], 0);
      if (s->kind == STEP_KEEP_FD && rc >= 0) ch->keep_fd = rc;
    }
    if (rc < 0) {
      ch->err = *c->errno_location();
      return i;
    }
  }
  return -1;
}

/* Forks children[0..n), each PID 1 of a new pid namespace (unshare before
 * the fork, setns back to pidns_fd after it). Returns, in child i: i, once
 * it has run its steps (see children[i].step_failed), holding only its own
 * ready pipe's write end. In the parent: -1 when every child was forked, or
 * one failed (children[i].failed_call and err; the rest were not forked);
 * -2 when setns back failed (children[i] was forked): later forks would land
 * in that child's namespace, so the caller must stop forking. */
int fs_spawn(const struct fs_libc *c, int pidns_fd, struct fs_child *children, int n,
             const struct fs_step *steps, int nsteps) {
  for (int i = 0; i < n; i++) {
    struct fs_child *ch = &children[i];
    struct timespec_ ts = {0, 0};
    int fds[2];
    ch->pid = 0;
    ch->ready_r = ch->ready_w = ch->keep_fd = -1;
    ch->step_failed = -1;
    ch->failed_call = CALL_NONE;
    c->clock_gettime(CLOCK_MONOTONIC, (long)&ts, 0, 0, 0, 0);
    ch->start_ns = ts.sec * 1000000000L + ts.nsec;
    if (c->pipe2((long)fds, O_CLOEXEC, 0, 0, 0, 0) < 0) {
      ch->failed_call = CALL_PIPE2;
      ch->err = *c->errno_location();
      return -1;
    }
    if (c->unshare(CLONE_NEWPID, 0, 0, 0, 0, 0) < 0) {
      ch->failed_call = CALL_UNSHARE;
      ch->err = *c->errno_location();
      c->close(fds[0], 0, 0, 0, 0, 0);
      c->close(fds[1], 0, 0, 0, 0, 0);
      return -1;
    }
    int pid = c->fork(0, 0, 0, 0, 0, 0);
    if (pid == 0) {
      for (int j = 0; j < i; j++) c->close(children[j].ready_r, 0, 0, 0, 0, 0); /* earlier siblings' */
      c->close(fds[0], 0, 0, 0, 0, 0);
      ch->ready_w = fds[1];
      ch->step_failed = run_steps(c, steps, nsteps, ch);
      return i;
    }
    int err = pid < 0 ? *c->errno_location() : 0;
    int back = c->setns(pidns_fd, CLONE_NEWPID, 0, 0, 0, 0);
    int back_err = back < 0 ? *c->errno_location() : 0;
    c->close(fds[1], 0, 0, 0, 0, 0);
    if (pid < 0) {
      c->close(fds[0], 0, 0, 0, 0, 0);
      ch->failed_call = CALL_FORK;
      ch->err = err;
    } else {
      ch->pid = pid;
      ch->ready_r = fds[0];
    }
    if (back < 0) {
      ch->failed_call = CALL_SETNS;
      ch->err = back_err;
      return -2;
    }
    if (pid < 0) return -1;
  }
  return -1;
}

/* ------------------------------------------------------------ the server loop
 *
 * The fork server's whole life after its set-up, in C: it reads a request
 * from the zygote, forks and sets up each child (fs_spawn), waits until each
 * says it is ready (or fails, or times out: killed), answers, and reaps its
 * exited children while idle. No Python runs in the server between two
 * requests nor between two forks, so its memory is the same at every fork:
 * a child holds no copy of a page the server wrote for an earlier request,
 * and every child starts from the bytes the template's pattern child
 * started from (forkling_reclaim's fr_adopt), so it matches the pattern page
 * for page. Messages (host byte order; the zygote is this machine):
 *
 *   request  u32 length of what follows, u32 kind, then
 *     FS_FORK   u32 n; n times: u8 id length, id, u8 host name length, host name, u8 flags
 *     FS_ADOPT  i32 pid, i32 fd (the pattern child's), u32 n, u32 nw; n struct fr_region (24 bytes, the
 *               pattern's runs), nw more (the pages it wrote)
 *   answer   u32 length of what follows, then
 *     FS_FORK   u32 n; n times: i32 pid, i32 status (FS_*), i32 errno, i32 length of text, i64
 *               setup ns, text (the failed call, or what the child said, at most FS_TEXT bytes)
 *     FS_ADOPT  i64 fr_adopt's result, i64 the pages each fork copies ahead (fr_prefault)
 *
 * Raw system calls (x86-64, as the process engine's seccomp filter) but
 * for fs_spawn's, which go through the caller's libc. */

enum { FS_FORK = 1, FS_ADOPT = 2 };
enum { FS_READY = 0, FS_CALL_FAILED = 1, FS_CHILD_FAILED = 2, FS_TIMED_OUT = 3, FS_NOT_FORKED = 4 };
#define FS_TEXT 512
#define FS_MAX_CHILDREN 4096
#define FS_MAX_REQUEST (1 << 20)

#if defined(__x86_64__)

#include "forkling_syscall.h"
enum { NR_read = 0, NR_write = 1, NR_close = 3, NR_poll = 7, NR_mmap = 9, NR_munmap = 11, NR_wait4 = 61, NR_kill = 62, NR_openat = 257 };
#define EINTR 4
#define EPROTO 71
#define ENOSYS 38
#define EPIPE 32
#define EIO 5

struct pollfd_ { int fd; short events, revents; };
struct name_ { char id[40]; char host[72]; };

/* n bytes into buf: 0; 1 at the end of the stream before its first byte; -errno. */
static long read_all(int fd, void *buf, long n) {
  long got = 0;
  while (got < n) {
    long k = sc(NR_read, fd, (long)buf + got, n - got, 0, 0, 0);
    if (k == -EINTR) continue;
    if (k < 0) return k;
    if (k == 0) return got ? -EPIPE : 1;
    got += k;
  }
  return 0;
}

static long write_all(int fd, const void *buf, long n) {
  for (long put = 0; put < n;) {
    long k = sc(NR_write, fd, (long)buf + put, n - put, 0, 0, 0);
    if (k == -EINTR) continue;
    if (k < 0) return k;
    put += k;
  }
  return 0;
}

static long now_ns(const struct fs_libc *c) {
  struct timespec_ ts = {0, 0};
  c->clock_gettime(CLOCK_MONOTONIC, (long)&ts, 0, 0, 0, 0);
  return ts.sec * 1000000000L + ts.nsec;
}

static void kill_wait(int pid) {
  sc(NR_kill, pid, 9, 0, 0, 0, 0);
  while (sc(NR_wait4, pid, 0, 0, 0, 0, 0) == -EINTR) {}
}

static void copy(char *dst, const char *src, long n) {
  for (long i = 0; i < n; i++) dst[i] = src[i];
}

/* n bytes of src as a NUL-ended string at dst. */
static void copy_str(char *dst, const char *src, long n) {
  copy(dst, src, n);
  dst[n] = 0;
}

static long align(long n) { return (n + 4095) & ~4095L; }

static const char *const call_name[] = {"", "pipe2", "unshare(CLONE_NEWPID)", "fork", "setns back to the fork server's pid namespace"};

/* What the server learnt of child k while it waited. */
struct wait_ { int status, text_len; long setup_ns; };

/* One FS_FORK request whose body (len bytes, after the kind) is next on the
 * socket. Returns, in a child, its index (a->id and the rest set); in the
 * server, -1 once answered, or -errno (the stream is out of step, or the
 * server must not fork again: setns back failed). */
static long serve_fork(const struct fs_libc *c, struct fs_serve *a, long len) {
  unsigned n;
  long r = read_all(a->sock, &n, 4);
  if (r) return r > 0 ? -EPIPE : r;
  if (n > FS_MAX_CHILDREN || len < 4) return -EPROTO;
  len -= 4;
  /* One mapping per request (a child unmaps its copy): children, names,
   * polls, waits, texts, the answer, the request's body. */
  long off[8];
  long sizes[7] = {n * (long)sizeof(struct fs_child), n * (long)sizeof(struct name_), n * (long)sizeof(struct pollfd_),
                   n * (long)sizeof(struct wait_), n * (long)FS_TEXT, 8 + n * (24L + FS_TEXT), len};
  off[0] = 0;
  for (int k = 0; k < 7; k++) off[k + 1] = off[k] + align(sizes[k]);
  long size = off[7];
  long m = sc(NR_mmap, 0, size, 3, 0x22 /* PRIVATE | ANONYMOUS */, -1, 0);
  if (m < 0 && m > -4096) return m;
  char *buf = (char *)m;
  struct fs_child *kids = (struct fs_child *)(buf + off[0]);
  struct name_ *names = (struct name_ *)(buf + off[1]);
  struct pollfd_ *polls = (struct pollfd_ *)(buf + off[2]);
  struct wait_ *w = (struct wait_ *)(buf + off[3]);
  char *texts = buf + off[4], *answer = buf + off[5], *body = buf + off[6];
  if ((r = read_all(a->sock, body, len))) {
    sc(NR_munmap, m, size, 0, 0, 0, 0);
    return r > 0 ? -EPIPE : r;
  }
  long at = 0;
  for (unsigned i = 0; i < n; i++) {
    unsigned id_len = at < len ? (unsigned char)body[at] : 99;
    unsigned host_len = at + 1 + id_len < len ? (unsigned char)body[at + 1 + id_len] : 99;
    if (id_len > 32 || host_len > 63 || at + 3 + id_len + host_len > len) {
      sc(NR_munmap, m, size, 0, 0, 0, 0);
      return -EPROTO;
    }
    copy_str(names[i].id, body + at + 1, id_len);
    copy_str(names[i].host, body + at + 2 + id_len, host_len);
    kids[i].id = names[i].id;
    kids[i].hostname = names[i].host;
    kids[i].hostname_len = host_len;
    kids[i].flags = (unsigned char)body[at + 2 + id_len + host_len];
    at += 3 + id_len + host_len;
  }
  int i = fs_spawn(c, a->pidns_fd, kids, (int)n, a->steps, (int)a->nsteps);
  if (i >= 0) { /* the child: what it needs, then no copy of the request (the server rewrites it) */
    struct fs_child *k = &kids[i];
    if (a->prefault && k->step_failed < 0) a->prefault(a->st); /* (while it has one thread: see fr_prefault) */
    a->index = i;
    a->flags = k->flags;
    a->ready_w = k->ready_w;
    a->keep_fd = k->keep_fd;
    a->step_failed = k->step_failed;
    a->err = k->err;
    copy(a->id, names[i].id, sizeof a->id);
    copy(a->hostname, names[i].host, sizeof a->hostname);
    sc(NR_munmap, m, size, 0, 0, 0, 0);
    return i;
  }
  /* Wait until each forked child says "ok" (ready; not waiting for the end
   * of its pipe, which a process it forked may hold) or closes its pipe
   * (failed: it wrote why), or until the time is up (killed). */
  unsigned waiting = 0;
  for (unsigned k = 0; k < n; k++) {
    polls[k].fd = kids[k].pid > 0 ? kids[k].ready_r : -1;
    polls[k].events = 1 /* POLLIN */;
    w[k].status = kids[k].pid > 0 ? FS_TIMED_OUT : kids[k].failed_call ? FS_CALL_FAILED : FS_NOT_FORKED;
    waiting += kids[k].pid > 0;
  }
  long deadline = now_ns(c) + a->ready_timeout_ms * 1000000L;
  while (waiting) {
    long left = (deadline - now_ns(c)) / 1000000L;
    long ev = left > 0 ? sc(NR_poll, (long)polls, n, left + 1, 0, 0, 0) : 0;
    if (ev == -EINTR) continue;
    if (ev <= 0) break; /* the time is up (or poll failed: the same) */
    for (unsigned k = 0; k < n; k++) {
      if (polls[k].fd < 0 || !polls[k].revents) continue;
      char *t = texts + (long)k * FS_TEXT, sink[256];
      long room = FS_TEXT - w[k].text_len;
      long rd = room > 0 ? sc(NR_read, polls[k].fd, (long)(t + w[k].text_len), room, 0, 0, 0)
                         : sc(NR_read, polls[k].fd, (long)sink, sizeof sink, 0, 0, 0); /* (the rest of a long text) */
      if (rd == -EINTR) continue;
      if (rd > 0 && room > 0) w[k].text_len += (int)rd;
      int ok = w[k].text_len == 2 && t[0] == 'o' && t[1] == 'k';
      if (rd > 0 && !ok) continue;
      sc(NR_close, polls[k].fd, 0, 0, 0, 0, 0);
      polls[k].fd = -1;
      waiting--;
      w[k].status = ok ? FS_READY : FS_CHILD_FAILED;
      if (ok) w[k].setup_ns = now_ns(c) - kids[k].start_ns;
      else kill_wait(kids[k].pid);
    }
  }
  for (unsigned k = 0; k < n; k++) {
    if (polls[k].fd < 0) continue;
    sc(NR_close, polls[k].fd, 0, 0, 0, 0, 0);
    kill_wait(kids[k].pid);
  }
  long put = 8;
  for (unsigned k = 0; k < n; k++) {
    const char *text = texts + (long)k * FS_TEXT;
    int tl = w[k].status == FS_CHILD_FAILED ? w[k].text_len : 0;
    if (w[k].status == FS_CALL_FAILED) {
      text = call_name[kids[k].failed_call < 5 ? kids[k].failed_call : 0];
      while (text[tl]) tl++;
    }
    int head[4] = {kids[k].pid, w[k].status, kids[k].err, tl};
    char *dst = answer + put;
    copy(dst, (const char *)head, 16);
    copy(dst + 16, (const char *)&w[k].setup_ns, 8);
    copy(dst + 24, text, tl);
    put += 24 + tl;
  }
  unsigned *head = (unsigned *)answer;
  head[0] = (unsigned)(put - 4);
  head[1] = n;
  r = write_all(a->sock, answer, put);
  sc(NR_munmap, m, size, 0, 0, 0, 0);
  if (i == -2) return -EIO; /* (answered: the zygote then sees this server end) */
  return r < 0 ? r : -1;
}

/* One FS_ADOPT request (body: len bytes after the kind): the pattern child's
 * file, opened again through /proc, and its runs, to a->adopt. */
static long serve_adopt(struct fs_serve *a, long len) {
  int head[4];
  long r = len >= 16 ? read_all(a->sock, head, 16) : -EPROTO;
  if (r) return r > 0 ? -EPIPE : r;
  long runs_len = len - 16;
  if ((unsigned)head[2] > 65536 || (unsigned)head[3] > 65536 || runs_len != ((long)(unsigned)head[2] + (unsigned)head[3]) * 24L) return -EPROTO;
  long size = align(runs_len ? runs_len : 1);
  long m = sc(NR_mmap, 0, size, 3, 0x22, -1, 0);
  if (m < 0 && m > -4096) return m;
  long res = read_all(a->sock, (void *)m, runs_len);
  if (res) {
    sc(NR_munmap, m, size, 0, 0, 0, 0);
    return res > 0 ? -EPIPE : res;
  }
  /* "/proc/<pid>/fd/<fd>" */
  char path[48] = "/proc/", digits[12];
  int p = 6;
  for (int k = 0; k < 2; k++) {
    long v = head[k];
    int nd = 0;
    if (v < 0) v = 0;
    do digits[nd++] = (char)('0' + v % 10); while ((v /= 10) && nd < 11);
    while (nd) path[p++] = digits[--nd];
    for (const char *t = k ? "" : "/fd/"; *t;) path[p++] = *t++;
  }
  path[p] = 0;
  long pages = 0;
  if (!a->adopt) {
    res = -ENOSYS;
  } else {
    long fd = sc(NR_openat, -100 /* AT_FDCWD */, (long)path, O_CLOEXEC | 04000 /* O_RDONLY | O_NONBLOCK: never a FIFO's wait */, 0, 0, 0);
    res = fd < 0 ? fd : a->adopt(a->st, fd, (const void *)m, head[2], (const char *)m + head[2] * 24L, head[3], &pages);
    if (fd >= 0 && res < 0) sc(NR_close, fd, 0, 0, 0, 0, 0);
  }
  sc(NR_munmap, m, size, 0, 0, 0, 0);
  char answer[20];
  unsigned l = 16;
  copy(answer, (const char *)&l, 4);
  copy(answer + 4, (const char *)&res, 8);
  copy(answer + 12, (const char *)&pages, 8);
  r = write_all(a->sock, answer, 20);
  return r < 0 ? r : -1;
}

/* The fork server's loop (see above). Returns in a child: its index (see
 * a->id and the rest); in the server: -EPIPE when the zygote has closed the socket,
 * or another -errno when the server must end. */
long fs_serve(const struct fs_libc *c, struct fs_serve *a) {
  for (;;) {
    struct pollfd_ pf = {a->sock, 1, 0};
    long ev = sc(NR_poll, (long)&pf, 1, a->reap_ms, 0, 0, 0);
    while (sc(NR_wait4, -1, 0, 1 /* WNOHANG */, 0, 0, 0) > 0) {} /* exited children */
    if (ev == 0 || ev == -EINTR) continue;
    if (ev < 0) return ev;
    unsigned head[2];
    long r = read_all(a->sock, head, 8);
    if (r) return r > 0 ? -EPIPE : r;
    if (head[0] < 4 || head[0] > FS_MAX_REQUEST) return -EPROTO;
    long len = head[0] - 4;
    r = head[1] == FS_FORK ? serve_fork(c, a, len) : head[1] == FS_ADOPT ? serve_adopt(a, len) : -EPROTO;
    if (r != -1) return r;
  }
}

#else /* not x86-64 */

long fs_serve(const struct fs_libc *c, struct fs_serve *a) {
  (void)c, (void)a;
  return -38; /* ENOSYS: the fork server runs its loop in Python */
}

#endif
