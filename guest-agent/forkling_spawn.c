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
#define FS_VERSION 2
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
};

/* sizeof of each structure, for the caller's check of its copies. */
void fs_sizes(long out[4]) {
  out[0] = sizeof(struct fs_libc);
  out[1] = sizeof(struct fs_step);
  out[2] = sizeof(struct fs_child);
  out[3] = 0;
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
