// The process engine's launcher: starts a process as PID 1 of new user, pid,
// mount, network, ipc, uts and cgroup namespaces, with an image's root
// filesystem as its root, and execs the agent there.
//
// Why C++ and not a helper program or Python: the image's python can only run
// once its root is in place, and Node cannot fork. clone() without CLONE_VM
// from the JS thread gives a child that is a copy of this process with one
// thread; until execve it uses raw system calls only (no malloc, no locks),
// on strings prepared by the parent. The parent (the keeper) joins the
// child's cgroups and makes its cgroup namespace before it clones it, writes
// its uid/gid maps (only it may map ranges) before the child goes on; errors
// before exec come back over a CLOEXEC pipe.
//
// Layout inside the child's mount namespace (stage = a host directory that
// only this namespace mounts over):
//   stage            tmpfs: the template's writable layer and the mount points
//   stage/image      the image's rootfs, bind mount, read-only
//   stage/upper,work overlay upper and work dirs (in the tmpfs)
//   stage/root       overlay(image, upper): becomes /
// and in the new root: /proc (new, for the new pid ns), /dev (tmpfs with
// null zero full random urandom tty bound from the host, a new devpts,
// /dev/shm), /run (tmpfs; /tmp stays in the overlay so BRANCH copies it), /run/forkling (a directory in that
// tmpfs, for the agent's Unix socket: the host reaches it through /proc/<pid>/root, see
// sandboxAgentSocket; no host directory is writable from inside), /run/forkling-layers/{image,upper} (what the zygote
// builds its children's read-only base from), /sys (empty, read-only).
// The old root is detached after pivot_root: no host path stays reachable.
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <grp.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <dirent.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <uv.h>

#include "errno_error.h"

#ifndef MS_NOSYMFOLLOW
#define MS_NOSYMFOLLOW 256
#endif

namespace forkling {
namespace {

// Steps, for error messages (the index is written back over the pipe).
const char* const kSteps[] = {
    "wait for the parent",              // 0
    "setresgid/setresuid to root",      // 1
    "unshare(CLONE_NEWCGROUP)",         // 2 (the keeper's)
    "make / private",                   // 3
    "mount the layer tmpfs",            // 4
    "mkdir in the layer",               // 5
    "bind the image read-only",         // 6
    "mount the overlay root",           // 7
    "mount /run",                       // 8
    "mkdir /run/forkling",              // 9
    "bind the layers for the zygote",   // 10
    "mount /proc",                      // 11
    "mount /dev",                       // 12
    "bind a device node",               // 13
    "mount /dev/pts",                   // 14
    "mount /dev/shm",                   // 15
    "bind the agent directory or /tmp", // 16
    "mount /sys",                       // 17
    "sethostname",                      // 18
    "bring up lo",                      // 19
    "pivot_root",                       // 20
    "detach the old root",              // 21
    "seccomp",                          // 22
    "stdio",                            // 23
    "execve",                           // 24
    "statfs of a bind mount",           // 25
    "clone the sandbox",                // 26
    "write the sandbox's uid/gid map",  // 27
    "move into the sandbox's cgroups",  // 28 (the keeper, before it clones the sandbox)
};

struct Prepared {
  // paths outside (host view)
  std::string stage, image, agent, upper, work, root, rootfs, agentDir;
  // The keeper's names of its mounts in the stage (the paths above are the sandbox's: see kStageFd).
  std::string kImage, kAgent, kSkeleton;
  // Without root: a tree of the image's directories owned by us, the top lower layer (see sandboxLaunch).
  std::string skeletonDir, skeleton, layersSkeleton;
  // paths inside the new root, still prefixed with `root`
  std::string run, runForkling, runAgent, layers, layersImage, layersUpper, proc, dev, pts, shm, sys, tmp;
  std::vector<std::string> devHost, devTarget;
  std::vector<std::pair<std::string, std::string>> devLinks;  // target, linkpath
  std::string layerOpts, overlayOpts, hostname;
  std::vector<std::string> argv, env;
  std::vector<char*> argvp, envp;
  std::vector<sock_filter> filter;
  std::vector<std::string> cgroupProcs;
  std::string innerUidMap, innerGidMap;
  bool keeperUserns = false;
  bool haveStdout = false;
  bool haveLifeline = false;
};

constexpr int kErrFd = 3;       // status pipe to Node (CLOEXEC: closes at execve)
constexpr int kStdoutFd = 4;    // becomes the sandbox's stdout/stderr
constexpr int kLifelineFd = 5;  // read end of Node's lifeline pipe: EOF = Node is gone (kept across execve)
constexpr int kSyncFd = 6;      // keeper <- Node go-ahead (CLOEXEC)
constexpr int kExecFd = 7;      // keeper's view of the sandbox reaching execve (CLOEXEC in the sandbox)
// The sandbox's stage, opened while it still has the keeper's credentials: as
// root its root is then an unprivileged host uid that may not pass the
// directories above the stage, so it names the stage /proc/self/fd/8.
constexpr int kStageFd = 8;

[[noreturn]] void Fail(int step, int err) {
  int msg[2] = {step, err};
  ssize_t ignored = write(kErrFd, msg, sizeof msg);
  (void)ignored;
  _exit(127);
}

bool MkdirP(const char* path) { return mkdir(path, 0755) == 0 || errno == EEXIST; }

bool WriteAll(const char* path, const char* data, size_t len) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = write(fd, data, len);
  int e = errno;
  close(fd);
  errno = e;
  return n == static_cast<ssize_t>(len);
}

// Formats a pid into buf (no allocation); returns the length.
size_t FormatPid(char* buf, long pid) {
  char tmp[24];
  size_t n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + pid % 10);
    pid /= 10;
  } while (pid > 0);
  for (size_t i = 0; i < n; i++) buf[i] = tmp[n - 1 - i];
  buf[n] = 0;
  return n;
}

// A read-only bind mount. A bind keeps the locked flags of the mount it came
// from (atime, noexec, ...) and a remount must repeat them.
void BindReadOnly(const char* src, const char* dst, int step) {
  if (mount(src, dst, nullptr, MS_BIND | MS_REC, nullptr) != 0) Fail(step, errno);
  struct statfs sf;
  if (statfs(dst, &sf) != 0) Fail(25, errno);
  unsigned long keep = 0;
  if (sf.f_flags & ST_NOATIME) keep |= MS_NOATIME;
  if (sf.f_flags & ST_NODIRATIME) keep |= MS_NODIRATIME;
  if (sf.f_flags & ST_RELATIME) keep |= MS_RELATIME;
  if (sf.f_flags & ST_NOEXEC) keep |= MS_NOEXEC;
  if (mount(nullptr, dst, nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep, nullptr) != 0) Fail(step, errno);
}

// The sandbox (the zygote, or a cold-booted sandbox): from the second clone to execve.
// Node's child (the keeper clones it with CLONE_PARENT), so that it can die with
// Node by PR_SET_PDEATHSIG: the agent also watches the lifeline fd (Node holds
// the only write end), but that is code the sandbox can patch. Before the
// go-ahead, the keeper's death (it dies with Node) shows as EOF on its pipe.
[[noreturn]] void SandboxMain(const Prepared& p, int syncR) {
  char c;
  if (read(syncR, &c, 1) != 1) _exit(126);
  close(syncR);
  // Without root on the host, the keeper's namespace denies setgroups (and so does ours, inherited).
  if (!p.keeperUserns && setgroups(0, nullptr) != 0) Fail(1, errno);
  {
    int fd = open(p.stage.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);  // (in our own mount namespace: mounts go there)
    if (fd < 0 || dup3(fd, kStageFd, O_CLOEXEC) < 0) Fail(5, errno);
    close(fd);
  }
  if (setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0) Fail(1, errno);
  // After the credentials change, which clears it; kept across execve (root of its own
  // user namespace already, the agent gains no capability there).
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) Fail(1, errno);
  if (p.haveLifeline) {  // Node gone before that: its lifeline has hung up
    struct pollfd pf = {kLifelineFd, POLLIN, 0};
    if (poll(&pf, 1, 0) > 0) _exit(126);
  }
  // A session (and process group) of our own: in Node's, kill(0, SIGKILL) from the sandbox
  // reached Node and every other sandbox (a process group ignores pid namespaces), and
  // /dev/tty was the user's terminal.
  if (setsid() < 0) Fail(1, errno);
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) Fail(3, errno);
  for (const std::string* d : {&p.upper, &p.work, &p.root}) {
    if (!MkdirP(d->c_str())) Fail(5, errno);
  }
  if (mount("overlay", p.root.c_str(), "overlay", MS_NOSUID | MS_NODEV, p.overlayOpts.c_str()) != 0) Fail(7, errno);
  // /tmp bound onto itself: the agent (PID 1) sees it mounted and does not put a
  // tmpfs there, so what the warm-up writes to /tmp stays in the layer children inherit.
  if (!MkdirP(p.tmp.c_str()) || mount(p.tmp.c_str(), p.tmp.c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(16, errno);

  const unsigned long quiet = MS_NOSUID | MS_NODEV;
  if (!MkdirP(p.run.c_str()) || mount("tmpfs", p.run.c_str(), "tmpfs", quiet | MS_NOEXEC, "mode=0755,size=16m") != 0) Fail(8, errno);
  if (!MkdirP(p.runForkling.c_str())) Fail(9, errno);
  if (!MkdirP(p.layers.c_str()) || !MkdirP(p.layersImage.c_str()) || !MkdirP(p.layersUpper.c_str())) Fail(10, errno);
  // The image bind was made read-only by the keeper, outside this user
  // namespace: it is locked read-only here and in every bind of it.
  if (mount(p.image.c_str(), p.layersImage.c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(10, errno);
  if (mount(p.upper.c_str(), p.layersUpper.c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(10, errno);
  if (!p.skeleton.empty()) {
    if (!MkdirP(p.layersSkeleton.c_str()) || mount(p.skeleton.c_str(), p.layersSkeleton.c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(10, errno);
  }
  if (!p.agentDir.empty()) {
    if (!MkdirP(p.runAgent.c_str()) || mount(p.agent.c_str(), p.runAgent.c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(16, errno);
  }
  if (!MkdirP(p.proc.c_str()) || mount("proc", p.proc.c_str(), "proc", quiet | MS_NOEXEC, nullptr) != 0) Fail(11, errno);
  if (!MkdirP(p.dev.c_str()) || mount("tmpfs", p.dev.c_str(), "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k") != 0) Fail(12, errno);
  for (size_t i = 0; i < p.devTarget.size(); i++) {
    int fd = open(p.devTarget[i].c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
    if (fd < 0) Fail(13, errno);
    close(fd);
    if (mount(p.devHost[i].c_str(), p.devTarget[i].c_str(), nullptr, MS_BIND, nullptr) != 0) Fail(13, errno);
  }
  if (!MkdirP(p.pts.c_str()) ||
      mount("devpts", p.pts.c_str(), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") != 0) {
    Fail(14, errno);
  }
  for (const auto& l : p.devLinks) {
    if (symlink(l.first.c_str(), l.second.c_str()) != 0) Fail(12, errno);
  }
  if (!MkdirP(p.shm.c_str()) || mount("tmpfs", p.shm.c_str(), "tmpfs", quiet, "mode=1777") != 0) Fail(15, errno);
  // An empty read-only /sys: no sysfs (host hardware) in the sandbox.
  if (!MkdirP(p.sys.c_str()) || mount("tmpfs", p.sys.c_str(), "tmpfs", quiet | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0555") != 0) {
    Fail(17, errno);
  }
  if (sethostname(p.hostname.data(), p.hostname.size()) != 0) Fail(18, errno);
  {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    memcpy(ifr.ifr_name, "lo", 3);
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) != 0) Fail(19, errno);
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0) Fail(19, errno);
    close(s);
  }
  if (chdir(p.root.c_str()) != 0 || syscall(SYS_pivot_root, ".", ".") != 0) Fail(20, errno);
  if (umount2(".", MNT_DETACH) != 0 || chdir("/") != 0) Fail(21, errno);

  // stdio: 0 from /dev/null, 1 and 2 to the console pipe (or /dev/null).
  int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (devnull < 0) Fail(23, errno);
  int out = p.haveStdout ? kStdoutFd : devnull;
  if (dup2(devnull, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0) Fail(23, errno);
  close(kStdoutFd);
  // keeps kErrFd and kExecFd (both CLOEXEC: they close at execve) and the lifeline
  syscall(SYS_close_range, kExecFd + 1, ~0U, 0);
  if (devnull > 2) close(devnull);

  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) Fail(22, errno);
  if (!p.filter.empty()) {
    struct sock_fprog prog;
    prog.len = static_cast<unsigned short>(p.filter.size());
    prog.filter = const_cast<sock_filter*>(p.filter.data());
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) Fail(22, errno);
  }
  execve(p.argvp[0], p.argvp.data(), p.envp.data());
  Fail(24, errno);
}

// The keeper: a copy of this process with one thread, in a mount namespace of
// its own (and, when we are not root, a user namespace mapping us to root).
// It mounts what must be locked read-only for the sandbox (the image, the
// agent directory) before the sandbox's user namespace exists, joins the
// sandbox's cgroups and makes its cgroup namespace, clones the sandbox, maps
// its ids, lets it go and exits once it has exec'd. Raw system calls only, on prepared data.
[[noreturn]] void KeeperMain(const Prepared& p, int syncR, int errW, int stdoutFd, int lifelineFd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the JS thread that launched it
  prctl(PR_SET_NAME, "forkling-keeper", 0, 0, 0);
  // Fixed fd numbers (see kErrFd...); nothing else of Node's.
  int e = fcntl(errW, F_DUPFD_CLOEXEC, 100);
  int o = fcntl(p.haveStdout ? stdoutFd : errW, F_DUPFD_CLOEXEC, 100);
  int l = fcntl(p.haveLifeline ? lifelineFd : errW, F_DUPFD_CLOEXEC, 100);
  int s = fcntl(syncR, F_DUPFD_CLOEXEC, 100);
  if (e < 0 || o < 0 || l < 0 || s < 0) _exit(125);
  dup3(e, kErrFd, O_CLOEXEC);
  dup2(o, kStdoutFd);
  if (p.haveLifeline) dup2(l, kLifelineFd);  // not CLOEXEC: the agent reads it
  dup3(s, kSyncFd, O_CLOEXEC);
  syscall(SYS_close_range, kSyncFd + 1, ~0U, 0);
  if (!p.haveLifeline) close(kLifelineFd);
  char c;
  if (read(kSyncFd, &c, 1) != 1) _exit(126);
  close(kSyncFd);
  // Node's signal handlers mean nothing here.
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < 65; sig++) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (p.keeperUserns) {
    if (setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0) Fail(1, errno);
  // After the credentials change, which clears it; kept across execve (root of its own
  // user namespace already, the agent gains no capability there).
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) Fail(1, errno);
  if (p.haveLifeline) {  // Node gone before that: its lifeline has hung up
    struct pollfd pf = {kLifelineFd, POLLIN, 0};
    if (poll(&pf, 1, 0) > 0) _exit(126);
  }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) Fail(3, errno);
  if (mount("forkling-layer", p.stage.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, p.layerOpts.c_str()) != 0) Fail(4, errno);
  if (!MkdirP(p.kImage.c_str())) Fail(5, errno);
  BindReadOnly(p.rootfs.c_str(), p.kImage.c_str(), 6);
  if (!p.skeletonDir.empty()) {
    if (!MkdirP(p.kSkeleton.c_str())) Fail(5, errno);
    BindReadOnly(p.skeletonDir.c_str(), p.kSkeleton.c_str(), 6);
  }
  if (!p.agentDir.empty()) {
    if (!MkdirP(p.kAgent.c_str())) Fail(5, errno);
    BindReadOnly(p.agentDir.c_str(), p.kAgent.c_str(), 16);
  }
  int sync2[2], execp[2];
  if (pipe2(sync2, O_CLOEXEC) != 0 || pipe2(execp, O_CLOEXEC) != 0) Fail(26, errno);
  // Out of the way of the fixed numbers first, then the exec pipe's write end at kExecFd.
  for (int* fd : {&sync2[0], &sync2[1], &execp[0], &execp[1]}) {
    int high = fcntl(*fd, F_DUPFD_CLOEXEC, 100);
    if (high < 0) Fail(26, errno);
    close(*fd);
    *fd = high;
  }
  if (dup3(execp[1], kExecFd, O_CLOEXEC) < 0) Fail(26, errno);
  close(execp[1]);
  // The sandbox is born in its cgroups, inside a cgroup namespace rooted
  // there that the keeper makes: one owned by the keeper's user namespace,
  // not the sandbox's. Mounting cgroup2 needs CAP_SYS_ADMIN in the owner of
  // the caller's cgroup namespace, so root in the sandbox cannot mount one;
  // and seccomp refuses it a new one. Where the host's cgroup2 lacks
  // nsdelegate and the sandbox's root is the owner of the cgroup files
  // (without root on the host), a mount would have let it raise its own
  // limits, or move itself into the zygote's cgroup and freeze or kill it.
  for (const auto& f : p.cgroupProcs) {
    if (!WriteAll(f.c_str(), "0", 1)) Fail(28, errno);  // (0: the writer)
  }
  if (unshare(CLONE_NEWCGROUP) != 0) Fail(2, errno);
  long pid = syscall(SYS_clone, CLONE_PARENT | CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                     nullptr, nullptr, nullptr, 0);
  if (pid == 0) {
    close(sync2[1]);
    close(execp[0]);
    SandboxMain(p, sync2[0]);
  }
  if (pid < 0) Fail(26, errno);
  close(sync2[0]);
  close(kExecFd);
  char path[64], num[24];
  size_t n = FormatPid(num, pid);
  const char* procPrefix = "/proc/";
  auto procPath = [&](const char* leaf) {
    size_t i = 0;
    for (const char* q = procPrefix; *q;) path[i++] = *q++;
    for (size_t k = 0; k < n;) path[i++] = num[k++];
    path[i++] = '/';
    for (const char* q = leaf; *q;) path[i++] = *q++;
    path[i] = 0;
    return path;
  };
  if (!WriteAll(procPath("uid_map"), p.innerUidMap.data(), p.innerUidMap.size())) Fail(27, errno);
  if (!WriteAll(procPath("gid_map"), p.innerGidMap.data(), p.innerGidMap.size())) Fail(27, errno);
  int msg[2] = {-1, static_cast<int>(pid)};
  if (write(kErrFd, msg, sizeof msg) != sizeof msg) _exit(125);
  if (write(sync2[1], "g", 1) != 1) Fail(26, errno);
  close(sync2[1]);
  close(kErrFd);  // the sandbox keeps its copy until execve: EOF then means it runs
  close(kStdoutFd);
  if (p.haveLifeline) close(kLifelineFd);
  // Wait until the sandbox has exec'd (or died), then go: a keeper that stayed
  // would hold a copy of every page Node writes from now on. The sandbox is
  // Node's child (CLONE_PARENT): Node watches and reaps it through a pidfd.
  ssize_t got;
  do {
    got = read(execp[0], &c, 1);
  } while (got < 0 && errno == EINTR);
  _exit(0);
}

// ------------------------------------------------------------------ seccomp

sock_filter Stmt(uint16_t code, uint32_t k) { return sock_filter{code, 0, 0, k}; }
sock_filter Jump(uint16_t code, uint32_t k, uint8_t jt, uint8_t jf) { return sock_filter{code, jt, jf, k}; }

// What a sandbox never needs. Mounting is allowed because the sandbox builds
// its children's roots (BRANCH); the user namespace limits it to the types a
// user namespace may mount (tmpfs, proc, overlay, devpts, ...), never a block
// device's file system. The new mount API is refused (the classic one is all
// set-up uses). x86-64 numbers.
const uint32_t kDenied[] = {
    246, 320,                 // kexec_load, kexec_file_load
    175, 313, 176, 174, 177, 178,  // init/finit/delete_module, create_module, get_kernel_syms, query_module
    321, 298,                 // bpf, perf_event_open
    250, 248, 249,            // keyctl, add_key, request_key
    101, 310, 311,            // ptrace, process_vm_readv, process_vm_writev
    // pidfd_getfd, kcmp, process_mrelease: another process's fds and memory (a fork holds a
    // pidfd of its fork server; root in the shared user namespace passes the ptrace check these
    // make); process_madvise too, but for the sandbox itself (below)
    438, 312, 448,
    167, 168, 169, 163,       // swapon, swapoff, reboot, acct
    164, 227, 305, 159,       // settimeofday, clock_settime, clock_adjtime, adjtimex
    172, 173, 103,            // iopl, ioperm, syslog
    212, 303, 304,            // lookup_dcookie, name_to_handle_at, open_by_handle_at
    323, 179, 443, 180,       // userfaultfd, quotactl, quotactl_fd, nfsservctl
    134, 153, 156,            // uselib, vhangup, _sysctl
    428, 429, 430, 431, 432, 433, 442,  // open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr
    425, 426, 427,            // io_uring_setup/enter/register
    300,                      // fanotify_init
};

std::vector<sock_filter> BuildFilter() {
  const uint32_t kEperm = SECCOMP_RET_ERRNO | EPERM;
  const uint32_t kNr = offsetof(struct seccomp_data, nr);
  const uint32_t kArch = offsetof(struct seccomp_data, arch);
  const uint32_t kArg0 = offsetof(struct seccomp_data, args[0]);
  const uint32_t kArg1 = offsetof(struct seccomp_data, args[1]);
  std::vector<sock_filter> f;
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kArch));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
  f.push_back(Stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));  // i386 / other ABIs: never
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kNr));
  f.push_back(Jump(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1));  // x32
  f.push_back(Stmt(BPF_RET | BPF_K, kEperm));
  for (uint32_t nr : kDenied) {
    f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1));
    f.push_back(Stmt(BPF_RET | BPF_K, kEperm));
  }
  // clone3 passes its flags in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, 435, 0, 1));
  f.push_back(Stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS));
  // clone (56) and unshare (272): no new user namespace, nor a cgroup namespace
  // (one of the sandbox's own would let it mount cgroup2: see KeeperMain) (flags
  // in the low half of arg 0).
  for (uint32_t nr : {56u, 272u}) {
    f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kNr));
    f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 3));
    f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kArg0));
    f.push_back(Jump(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER | CLONE_NEWCGROUP, 0, 1));
    f.push_back(Stmt(BPF_RET | BPF_K, kEperm));
  }
  // process_madvise (440): only on itself (PIDFD_SELF_THREAD, PIDFD_SELF_THREAD_GROUP: the
  // low half of arg 0, the int the kernel reads), which madvise allows anyway: an idle fork gives
  // back many runs in one call and one TLB flush (forkling_reclaim.c), never another's memory.
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kNr));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, 440, 0, 4));
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kArg0));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(-10000), 2, 0));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(-20000), 1, 0));
  f.push_back(Stmt(BPF_RET | BPF_K, kEperm));
  // setns (308): only into a pid namespace (the fork of N children resets
  // its pid namespace for children this way); nothing else.
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kNr));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, 308, 0, 3));
  f.push_back(Stmt(BPF_LD | BPF_W | BPF_ABS, kArg1));
  f.push_back(Jump(BPF_JMP | BPF_JEQ | BPF_K, CLONE_NEWPID, 1, 0));
  f.push_back(Stmt(BPF_RET | BPF_K, kEperm));
  f.push_back(Stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  return f;
}

// ------------------------------------------------------------------ JS side

std::string GetStr(Napi::Object o, const char* field) {
  Napi::Value v = o.Get(field);
  if (!v.IsString()) throw Napi::TypeError::New(o.Env(), std::string(field) + " must be a string");
  std::string s = v.As<Napi::String>().Utf8Value();
  if (s.find('\0') != std::string::npos) throw Napi::TypeError::New(o.Env(), std::string(field) + " contains a NUL");
  return s;
}

std::vector<std::string> GetStrs(Napi::Object o, const char* field) {
  Napi::Value v = o.Get(field);
  if (!v.IsArray()) throw Napi::TypeError::New(o.Env(), std::string(field) + " must be an array of strings");
  Napi::Array a = v.As<Napi::Array>();
  std::vector<std::string> out;
  for (uint32_t i = 0; i < a.Length(); i++) {
    Napi::Value e = a.Get(i);
    if (!e.IsString()) throw Napi::TypeError::New(o.Env(), std::string(field) + " must be an array of strings");
    std::string s = e.As<Napi::String>().Utf8Value();
    if (s.find('\0') != std::string::npos) throw Napi::TypeError::New(o.Env(), std::string(field) + " contains a NUL");
    out.push_back(std::move(s));
  }
  return out;
}

bool WriteFile(const std::string& path, const std::string& data) {
  int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = write(fd, data.data(), data.size());
  int e = errno;
  close(fd);
  errno = e;
  return n == static_cast<ssize_t>(data.size());
}

void KillAndReap(pid_t pid) {
  kill(pid, SIGKILL);
  int st;
  while (waitpid(pid, &st, __WALL) < 0 && errno == EINTR) {
  }
}

// sandboxLaunch({rootfs, skeleton?, idBase?, stage, agentDir?, hostname, argv, env, cgroupProcs,
//                layerSizeMiB?, stdoutFd?, lifelineFd?, seccomp}) -> {pid, keeperPid}
// idBase (as root, required): the host uid/gid of the sandbox's root, the first of 65536.
// skeleton: a tree of the rootfs's directories owned by the sandbox's root, the
// overlay's top lower layer. The image's files belong to the host's root, which
// our user namespace cannot map, and overlayfs refuses to copy up what it cannot
// chown (EOVERFLOW): with the skeleton every directory is ours, so new files can
// be made anywhere (the image's own files stay read-only).
// pid: the sandbox (PID 1 of its namespaces, as seen here; not our child:
// watch it with sandboxWatch); keeperPid: our child, gone once the sandbox
// runs (reap it with sandboxWatch). lifelineFd: the read end of a pipe whose
// write end only this process holds; the sandbox gets it as fd 5 and ends
// itself at EOF (the agent watches it), which covers our death.
Napi::Value Launch(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsObject()) throw Napi::TypeError::New(env, "options must be an object");
  Napi::Object o = info[0].As<Napi::Object>();
  Prepared p;
  p.rootfs = GetStr(o, "rootfs");
  p.stage = GetStr(o, "stage");
  p.agentDir = o.Get("agentDir").IsString() ? GetStr(o, "agentDir") : "";
  p.skeletonDir = o.Get("skeleton").IsString() ? GetStr(o, "skeleton") : "";
  p.hostname = GetStr(o, "hostname");
  p.argv = GetStrs(o, "argv");
  p.env = GetStrs(o, "env");
  p.cgroupProcs = GetStrs(o, "cgroupProcs");
  if (p.argv.empty() || p.argv[0].empty() || p.argv[0][0] != '/') throw Napi::TypeError::New(env, "argv[0] must be an absolute path");
  if (p.hostname.empty() || p.hostname.size() > 64) throw Napi::RangeError::New(env, "hostname must have 1-64 characters");
  for (const std::string* s : {&p.rootfs, &p.stage, &p.agentDir, &p.skeletonDir}) {
    if ((s == &p.agentDir || s == &p.skeletonDir) && s->empty()) continue;
    if (s->empty() || (*s)[0] != '/' || s->find_first_of(",:\\") != std::string::npos) {
      throw Napi::TypeError::New(env, "rootfs, skeleton, stage and agentDir must be absolute paths without , : or \\");
    }
  }
  uint32_t layerMiB = o.Get("layerSizeMiB").IsNumber() ? o.Get("layerSizeMiB").As<Napi::Number>().Uint32Value() : 1024;
  int stdoutFd = o.Get("stdoutFd").IsNumber() ? o.Get("stdoutFd").As<Napi::Number>().Int32Value() : -1;
  p.haveStdout = stdoutFd >= 0;
  int lifelineFd = o.Get("lifelineFd").IsNumber() ? o.Get("lifelineFd").As<Napi::Number>().Int32Value() : -1;
  p.haveLifeline = lifelineFd >= 0;
  if (o.Get("seccomp").ToBoolean()) p.filter = BuildFilter();

  // Root maps the sandbox's 0-65535 onto the host's idBase.. (unprivileged
  // ids no one else uses): mapped onto the host's 0-65535, the sandbox's root
  // was the host's root uid, which global sysctls in a /proc it mounts check
  // for (it could write kernel.core_pattern: a way out). Anyone else maps the
  // sandbox's root onto themselves, through the keeper's user namespace. Either
  // way the image's files belong to a uid the sandbox cannot map (the skeleton
  // lets it make new files anywhere).
  uid_t uid = geteuid();
  gid_t gid = getegid();
  p.keeperUserns = uid != 0;
  uint32_t idBase = o.Get("idBase").IsNumber() ? o.Get("idBase").As<Napi::Number>().Uint32Value() : 0;
  if (!p.keeperUserns && (idBase == 0 || idBase > 0xFFFF0000u)) throw Napi::TypeError::New(env, "idBase: as root, a host uid above 0 (and below 2^32 - 65536) for the sandboxes' root");
  p.innerUidMap = p.keeperUserns ? "0 0 1\n" : "0 " + std::to_string(idBase) + " 65536\n";
  p.innerGidMap = p.keeperUserns ? "0 0 1\n" : "0 " + std::to_string(idBase) + " 65536\n";

  p.kImage = p.stage + "/image";
  p.kAgent = p.stage + "/agent";
  p.kSkeleton = p.stage + "/skeleton";
  const std::string st = "/proc/self/fd/" + std::to_string(kStageFd);
  p.image = st + "/image";
  p.agent = st + "/agent";
  p.upper = st + "/upper";
  p.work = st + "/work";
  p.root = st + "/root";
  p.run = p.root + "/run";
  p.runForkling = p.run + "/forkling";
  p.runAgent = p.run + "/forkling-agent";
  p.layers = p.run + "/forkling-layers";
  p.layersImage = p.layers + "/image";
  p.layersUpper = p.layers + "/upper";
  p.proc = p.root + "/proc";
  p.dev = p.root + "/dev";
  p.pts = p.dev + "/pts";
  p.shm = p.dev + "/shm";
  p.sys = p.root + "/sys";
  p.tmp = p.root + "/tmp";
  for (const char* d : {"null", "zero", "full", "random", "urandom", "tty"}) {
    p.devHost.push_back(std::string("/dev/") + d);
    p.devTarget.push_back(p.dev + "/" + d);
  }
  p.devLinks = {{"pts/ptmx", p.dev + "/ptmx"},
                {"/proc/self/fd", p.dev + "/fd"},
                {"/proc/self/fd/0", p.dev + "/stdin"},
                {"/proc/self/fd/1", p.dev + "/stdout"},
                {"/proc/self/fd/2", p.dev + "/stderr"}};
  p.layerOpts = "mode=0755,size=" + std::to_string(layerMiB) + "m";
  // (as root: the sandbox's root owns its stage, where it makes its upper layer)
  if (!p.keeperUserns) p.layerOpts += ",uid=" + std::to_string(idBase) + ",gid=" + std::to_string(idBase);
  if (!p.skeletonDir.empty()) {
    p.skeleton = st + "/skeleton";
    p.layersSkeleton = p.layers + "/skeleton";
  }
  p.overlayOpts = "lowerdir=" + (p.skeleton.empty() ? p.image : p.skeleton + ":" + p.image) + ",upperdir=" + p.upper + ",workdir=" + p.work + ",userxattr";
  for (auto& s : p.argv) p.argvp.push_back(s.data());
  p.argvp.push_back(nullptr);
  for (auto& s : p.env) p.envp.push_back(s.data());
  p.envp.push_back(nullptr);

  int syncp[2], errp[2];
  if (pipe2(syncp, O_CLOEXEC) != 0) throw ErrnoError(env, "pipe2", errno);
  if (pipe2(errp, O_CLOEXEC) != 0) {
    int e = errno;
    close(syncp[0]);
    close(syncp[1]);
    throw ErrnoError(env, "pipe2", e);
  }
  unsigned long flags = CLONE_NEWNS | SIGCHLD;
  if (p.keeperUserns) flags |= CLONE_NEWUSER;
  long keeper = syscall(SYS_clone, flags, nullptr, nullptr, nullptr, 0);
  if (keeper == 0) {
    KeeperMain(p, syncp[0], errp[1], stdoutFd, lifelineFd);
  }
  int cloneErr = errno;
  close(syncp[0]);
  close(errp[1]);
  if (keeper < 0) {
    close(syncp[1]);
    close(errp[0]);
    throw ErrnoError(env, "clone", cloneErr);
  }
  auto fail = [&](const std::string& what, int e) {
    close(syncp[1]);
    close(errp[0]);
    KillAndReap(static_cast<pid_t>(keeper));
    throw ErrnoError(env, what, e);
  };
  if (p.keeperUserns) {
    std::string procDir = "/proc/" + std::to_string(keeper);
    if (!WriteFile(procDir + "/setgroups", "deny")) fail("write setgroups", errno);
    if (!WriteFile(procDir + "/uid_map", "0 " + std::to_string(uid) + " 1\n")) fail("write uid_map", errno);
    if (!WriteFile(procDir + "/gid_map", "0 " + std::to_string(gid) + " 1\n")) fail("write gid_map", errno);
  }
  if (write(syncp[1], "g", 1) != 1) fail("write to the keeper", errno);
  close(syncp[1]);
  // Messages until EOF (the sandbox exec'd): {-1, pid} then, on failure, {step, errno}.
  long pid = -1;
  int failStep = -1, failErr = 0;
  for (;;) {
    int msg[2];
    ssize_t n;
    do {
      n = read(errp[0], msg, sizeof msg);
    } while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(sizeof msg)) break;
    if (msg[0] == -1) pid = msg[1];
    else {
      failStep = msg[0];
      failErr = msg[1];
    }
  }
  close(errp[0]);
  if (failStep >= 0 || pid <= 0) {
    KillAndReap(static_cast<pid_t>(keeper));
    int step = failStep >= 0 && failStep < static_cast<int>(sizeof kSteps / sizeof kSteps[0]) ? failStep : 0;
    Napi::Error err = failStep >= 0 ? ErrnoError(env, std::string("sandbox set-up: ") + kSteps[step], failErr)
                                    : Napi::Error::New(env, "sandbox set-up: the keeper process died before the sandbox started");
    err.Set("step", Napi::String::New(env, failStep >= 0 ? kSteps[step] : "keeper"));
    throw err;
  }
  Napi::Object r = Napi::Object::New(env);
  r.Set("pid", Napi::Number::New(env, static_cast<double>(pid)));
  r.Set("keeperPid", Napi::Number::New(env, static_cast<double>(keeper)));
  return r;
}

Napi::Object StatusObject(Napi::Env env, int st) {
  Napi::Object r = Napi::Object::New(env);
  if (WIFEXITED(st)) {
    r.Set("code", Napi::Number::New(env, WEXITSTATUS(st)));
    r.Set("signal", env.Null());
  } else {
    r.Set("code", env.Null());
    r.Set("signal", Napi::Number::New(env, WIFSIGNALED(st) ? WTERMSIG(st) : 0));
  }
  return r;
}

// sandboxReap(pid) -> null while it runs, else {code, signal}. Never blocks.
Napi::Value Reap(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) throw Napi::TypeError::New(env, "pid must be a number");
  pid_t pid = info[0].As<Napi::Number>().Int32Value();
  int st = 0;
  pid_t r = waitpid(pid, &st, WNOHANG | __WALL);
  if (r < 0) throw ErrnoError(env, "waitpid", errno);
  if (r == 0) return env.Null();
  return StatusObject(env, st);
}

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

// sandboxWatch(pid, callback) and sandboxWatchPidfd(pidfd, callback, reap):
// call callback({code, signal}) once the process has exited. sandboxWatch
// reaps it if it is our child (through its pidfd, never by number: that may
// be a later process's by then); sandboxWatchPidfd only if asked (a child of
// ours may be someone else's to reap: Node's child_process, say). Another process's
// status is unknown to us ({code: null, signal: null}). Event-driven: a pidfd
// polled by the event loop, never a blocked thread-pool thread. The watch
// does not keep the loop alive.
struct PidWatch {
  uv_poll_t poll;
  int pidfd;
  bool reap;
  napi_env env;
  Napi::FunctionReference callback;
  Napi::AsyncContext* context;
};

void OnPidfd(uv_poll_t* handle, int status, int events) {
  auto* w = static_cast<PidWatch*>(handle->data);
  siginfo_t si;
  memset(&si, 0, sizeof si);
  int r = waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(w->pidfd), &si, WEXITED | WNOHANG | __WALL | (w->reap ? 0 : WNOWAIT));
  if (r == 0 && si.si_pid == 0) return;  // our child, not exited yet (spurious wake-up)
  // (r < 0, ECHILD: not our child; its pidfd is readable, so it has exited)
  uv_poll_stop(handle);
  Napi::Env env(w->env);
  // Nothing may be thrown out of a libuv callback (std::terminate). The exit
  // can also come while Node tears its environment down at the end of the
  // process (its last loop run), when no JavaScript can run: then there is
  // nobody left to tell.
  try {
    Napi::HandleScope scope(env);
    Napi::Object result = Napi::Object::New(env);
    bool exited = r == 0 && si.si_code == CLD_EXITED;
    bool killed = r == 0 && (si.si_code == CLD_KILLED || si.si_code == CLD_DUMPED);
    result.Set("code", exited ? Napi::Number::New(env, si.si_status) : env.Null());
    result.Set("signal", killed ? Napi::Number::New(env, si.si_status) : env.Null());
    Napi::CallbackScope cs(env, *w->context);  // runs the microtasks the callback queues
    w->callback.Call({result});
  } catch (const Napi::Error& e) {
    // A callback that threw (the engine's own do not): reported as Node reports an uncaught exception.
    if (!e.Message().empty()) napi_fatal_exception(env, e.Value());
  }
  uv_close(reinterpret_cast<uv_handle_t*>(handle), [](uv_handle_t* h) {
    auto* w = static_cast<PidWatch*>(h->data);
    close(w->pidfd);
    delete w->context;
    delete w;
  });
}

// Takes `fd` (a pidfd of our own): closed when the watch ends, or here on failure.
void StartWatch(Napi::Env env, int fd, bool reap, Napi::Function callback) {
  uv_loop_s* loop = nullptr;
  if (napi_get_uv_event_loop(env, &loop) != napi_ok || loop == nullptr) {
    close(fd);
    throw Napi::Error::New(env, "no event loop");
  }
  auto* w = new PidWatch;
  w->pidfd = fd;
  w->reap = reap;
  w->env = env;
  w->callback = Napi::Persistent(callback);
  w->context = new Napi::AsyncContext(env, "forkling.sandboxWatch");
  w->poll.data = w;
  int e = uv_poll_init(loop, &w->poll, fd);
  if (e == 0) e = uv_poll_start(&w->poll, UV_READABLE, OnPidfd);
  if (e != 0) {
    close(fd);
    delete w->context;
    delete w;
    throw Napi::Error::New(env, std::string("uv_poll on a pidfd failed: ") + uv_strerror(e));
  }
  uv_unref(reinterpret_cast<uv_handle_t*>(&w->poll));
}

Napi::Value Watch(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) throw Napi::TypeError::New(env, "pid must be a number");
  if (!info[1].IsFunction()) throw Napi::TypeError::New(env, "callback must be a function");
  pid_t pid = info[0].As<Napi::Number>().Int32Value();
  int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) throw ErrnoError(env, "pidfd_open", errno);
  StartWatch(env, fd, true, info[1].As<Napi::Function>());
  return env.Undefined();
}

Napi::Value WatchPidfd(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) throw Napi::TypeError::New(env, "pidfd must be a number");
  if (!info[1].IsFunction()) throw Napi::TypeError::New(env, "callback must be a function");
  bool reap = info[2].IsBoolean() && info[2].As<Napi::Boolean>().Value();
  int fd = fcntl(info[0].As<Napi::Number>().Int32Value(), F_DUPFD_CLOEXEC, 3);  // (the caller keeps and closes its own)
  if (fd < 0) throw ErrnoError(env, "dup of a pidfd", errno);
  StartWatch(env, fd, reap, info[1].As<Napi::Function>());
  return env.Undefined();
}

// sandboxPidfd(pid) -> a pidfd (close-on-exec) of that process: signals sent
// through it reach that process or none, never a later one given its number.
Napi::Value Pidfd(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) throw Napi::TypeError::New(env, "pid must be a number");
  int fd = static_cast<int>(syscall(SYS_pidfd_open, info[0].As<Napi::Number>().Int32Value(), 0));
  if (fd < 0) throw ErrnoError(env, "pidfd_open", errno);
  return Napi::Number::New(env, fd);
}

// sandboxSignal(pidfd, signal) -> true if sent, false if that process has exited.
Napi::Value Signal(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber() || !info[1].IsNumber()) throw Napi::TypeError::New(env, "pidfd and signal must be numbers");
  int fd = info[0].As<Napi::Number>().Int32Value();
  int sig = info[1].As<Napi::Number>().Int32Value();
  if (syscall(SYS_pidfd_send_signal, fd, sig, nullptr, 0) == 0) return Napi::Boolean::New(env, true);
  if (errno == ESRCH) return Napi::Boolean::New(env, false);
  throw ErrnoError(env, "pidfd_send_signal", errno);
}

// pipe2(O_CLOEXEC) -> [readFd, writeFd]: the console pipe of a zygote.
Napi::Value Pipe(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw ErrnoError(env, "pipe2", errno);
  Napi::Array a = Napi::Array::New(env, 2);
  a.Set(0u, Napi::Number::New(env, fds[0]));
  a.Set(1u, Napi::Number::New(env, fds[1]));
  return a;
}

// sandboxOpaque(dir): marks a directory of a skeleton opaque to the layers
// below it (user.overlay.opaque, for overlays mounted with userxattr): one we
// could not read, whose lower copy an overlay would refuse to look into.
Napi::Value Opaque(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsString()) throw Napi::TypeError::New(env, "dir must be a string");
  std::string dir = info[0].As<Napi::String>().Utf8Value();
  if (setxattr(dir.c_str(), "user.overlay.opaque", "y", 1, 0) != 0) throw ErrnoError(env, "setxattr user.overlay.opaque", errno);
  return env.Undefined();
}

// Removing what a sandbox could write (its runtime directory, bound at
// /run/forkling inside) without ever following a symbolic link: each
// directory is opened relative to its parent's fd with O_NOFOLLOW, so an entry
// swapped for a link meanwhile is removed as the link, and no path grows long.
constexpr int kMaxRemoveDepth = 4096;

// Removes entry `name` of directory `parent` and all below it. Returns 0, or
// the first errno (with what failed in *what).
int RemoveAt(int parent, const char* name, int depth, std::string* what) {
  for (int tries = 0; tries < 4; tries++) {
    if (unlinkat(parent, name, 0) == 0 || errno == ENOENT) return 0;
    if (errno != EISDIR) {
      *what = std::string("unlink ") + name;
      return errno;
    }
    if (depth >= kMaxRemoveDepth) {
      *what = "directories nested deeper than 4096";
      return ELOOP;
    }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) return 0;
      if (errno == ENOTDIR || errno == ELOOP) continue;  // swapped for a file or link: unlink it
      *what = std::string("open ") + name;
      return errno;
    }
    DIR* d = fdopendir(fd);
    if (!d) {
      int e = errno;
      close(fd);
      *what = "fdopendir";
      return e;
    }
    bool chmoded = false;
    int err = 0;
    for (;;) {
      errno = 0;
      struct dirent* ent = readdir(d);
      if (!ent) break;
      if (!strcmp(ent->d_name, ".") || !strcmp(ent->d_name, "..")) continue;
      int e = RemoveAt(dirfd(d), ent->d_name, depth + 1, what);
      if (e == EACCES && !chmoded) {  // (without root: a 0500 directory the sandbox made, ours on the host)
        chmoded = true;
        if (fchmod(dirfd(d), 0700) == 0) e = RemoveAt(dirfd(d), ent->d_name, depth + 1, what);
      }
      if (e && !err) err = e;
    }
    closedir(d);
    if (err) return err;
    if (unlinkat(parent, name, AT_REMOVEDIR) == 0 || errno == ENOENT) return 0;
    if (errno != ENOTEMPTY) {
      *what = std::string("rmdir ") + name;
      return errno;
    }
    // (something wrote into it meanwhile: once more)
  }
  *what = std::string("rmdir ") + name + ": it keeps filling";
  return ENOTEMPTY;
}

// sandboxRemoveTree(base, rel): removes base/rel and all below it, never
// following a symbolic link in rel or below (base is the host's own, trusted).
// Returns null, or what failed.
Napi::Value RemoveTree(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsString() || !info[1].IsString()) throw Napi::TypeError::New(env, "base and rel must be strings");
  std::string base = info[0].As<Napi::String>().Utf8Value();
  std::string rel = info[1].As<Napi::String>().Utf8Value();
  std::vector<std::string> parts;
  for (size_t at = 0; at <= rel.size();) {
    size_t slash = rel.find('/', at);
    if (slash == std::string::npos) slash = rel.size();
    std::string part = rel.substr(at, slash - at);
    if (part == "..") throw Napi::TypeError::New(env, "rel must not contain ..");
    if (!part.empty() && part != ".") parts.push_back(part);
    at = slash + 1;
  }
  if (parts.empty()) throw Napi::TypeError::New(env, "rel names nothing below base");
  int fd = open(base.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? env.Null() : Napi::String::New(env, "open " + base + ": " + strerror(errno));
  for (size_t i = 0; i + 1 < parts.size(); i++) {
    int next = openat(fd, parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int e = errno;
    close(fd);
    if (next < 0) return e == ENOENT ? env.Null() : Napi::String::New(env, "open " + parts[i] + " (no link followed): " + strerror(e));
    fd = next;
  }
  std::string what;
  int e = RemoveAt(fd, parts.back().c_str(), 0, &what);
  close(fd);
  if (!e) return env.Null();
  return Napi::String::New(env, what + ": " + strerror(e));
}

// sandboxAgentSocket(pid, rel) -> fd: an O_PATH fd of the Unix socket at `rel`
// below the root directory of process `pid` (a sandbox's PID 1), for the host
// to connect to as /proc/self/fd/<fd>. The socket lives in the sandbox's own
// /run tmpfs (no host directory is writable from a sandbox); the sandbox may
// have put a link there: no symbolic or magic link is followed, and `..`
// stays below its root. The pidfd, taken first and checked last, makes sure
// that the root opened was that process's and not a new process's that reused
// its pid.
Napi::Value AgentSocket(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber() || !info[1].IsString()) throw Napi::TypeError::New(env, "pid must be a number and rel a string");
  int pid = info[0].As<Napi::Number>().Int32Value();
  std::string rel = info[1].As<Napi::String>().Utf8Value();
  if (pid <= 0) throw Napi::RangeError::New(env, "pid must be positive");
  if (rel.empty() || rel[0] == '/' || rel.find('\0') != std::string::npos) throw Napi::TypeError::New(env, "rel must be a relative path");
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) throw ErrnoError(env, "pidfd_open", errno);
  std::string rootPath = "/proc/" + std::to_string(pid) + "/root";
  int root = open(rootPath.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (root < 0) {
    int e = errno;
    close(pidfd);
    throw ErrnoError(env, "open " + rootPath, e);
  }
  struct open_how how;
  memset(&how, 0, sizeof how);
  how.flags = O_PATH | O_NOFOLLOW | O_CLOEXEC;
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  int fd = static_cast<int>(syscall(SYS_openat2, root, rel.c_str(), &how, sizeof how));
  int e = errno;
  close(root);
  struct stat st;
  const char* what = nullptr;
  if (fd < 0) {
    what = "open";
  } else if (fstat(fd, &st) != 0) {
    e = errno;
    what = "fstat";
  } else if (!S_ISSOCK(st.st_mode)) {  // (what stops a link as the last component: O_PATH|O_NOFOLLOW opens the link itself)
    e = ENOTSOCK;
    what = "check";
  } else {
    struct pollfd pfd = {pidfd, POLLIN, 0};
    if (poll(&pfd, 1, 0) != 0) {  // exited (or an error): the root may have been another process's
      e = ESRCH;
      what = "check";
    }
  }
  close(pidfd);
  if (what) {
    if (fd >= 0) close(fd);
    throw ErrnoError(env, std::string(what) + " " + rel + " in the root of process " + std::to_string(pid), e);
  }
  return Napi::Number::New(env, fd);
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

// sandboxPeerPid(fd) -> pid: the pid (in our pid namespace) of the process that
// made the other end of a connected Unix socket (for an accepted connection,
// the one that listened), or -1 if that process has exited: whether the agent
// that answers is the sandbox's. A pidfd of it (SO_PEERPIDFD, Linux 6.5) where
// the kernel has one: SO_PEERCRED's pid is a number taken at listen(), which
// a new process may have been given since that one exited.
Napi::Value PeerPid(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (!info[0].IsNumber()) throw Napi::TypeError::New(env, "fd must be a number");
  int fd = info[0].As<Napi::Number>().Int32Value();
  int pidfd = -1;
  socklen_t len = sizeof pidfd;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
    int info_fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = info_fd < 0 ? -1 : read(info_fd, buf, sizeof buf - 1);
    int e = errno;
    if (info_fd >= 0) close(info_fd);
    close(pidfd);
    if (n < 0) throw ErrnoError(env, std::string("read ") + path, e);
    buf[n] = 0;
    const char* at = strstr(buf, "\nPid:");
    if (!at) throw Napi::Error::New(env, std::string(path) + " has no Pid line");
    return Napi::Number::New(env, strtol(at + 5, nullptr, 10));  // (-1: it has exited)
  }
  // EINVAL: the kernel has SO_PEERPIDFD but the listener has exited (no pidfd for a pid
  // without a task, before Linux 6.15): refused, never read again as a number.
  if (errno == EINVAL) return Napi::Number::New(env, -1);
  if (errno != ENOPROTOOPT) throw ErrnoError(env, "getsockopt SO_PEERPIDFD", errno);
  struct ucred cred;
  len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) throw ErrnoError(env, "getsockopt SO_PEERCRED", errno);
  return Napi::Number::New(env, cred.pid);
}

}  // namespace

void InitSandbox(Napi::Env env, Napi::Object exports) {
  exports.Set("sandboxRemoveTree", Napi::Function::New(env, RemoveTree, "sandboxRemoveTree"));
  exports.Set("sandboxOpaque", Napi::Function::New(env, Opaque, "sandboxOpaque"));
  exports.Set("sandboxLaunch", Napi::Function::New(env, Launch, "sandboxLaunch"));
  exports.Set("sandboxReap", Napi::Function::New(env, Reap, "sandboxReap"));
  exports.Set("sandboxWatch", Napi::Function::New(env, Watch, "sandboxWatch"));
  exports.Set("sandboxWatchPidfd", Napi::Function::New(env, WatchPidfd, "sandboxWatchPidfd"));
  exports.Set("sandboxPidfd", Napi::Function::New(env, Pidfd, "sandboxPidfd"));
  exports.Set("sandboxSignal", Napi::Function::New(env, Signal, "sandboxSignal"));
  exports.Set("sandboxPipe", Napi::Function::New(env, Pipe, "sandboxPipe"));
  exports.Set("sandboxAgentSocket", Napi::Function::New(env, AgentSocket, "sandboxAgentSocket"));
  exports.Set("sandboxPeerPid", Napi::Function::New(env, PeerPid, "sandboxPeerPid"));
}

}  // namespace forkling
