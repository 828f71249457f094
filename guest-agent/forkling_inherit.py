"""forkling_inherit: a forked child's own copy of what its parent has open.

fork() shares the parent's open file descriptions, pipes, sockets, epoll
instances and MAP_SHARED pages with the child. In the process engine the
parent is a template's zygote (every fork of the template shares them) or a
running sandbox (a BRANCH shares them with its source): a child writing
through a file the warm-up left open would write the template's copy, which
every sibling reads through its base layer; an asyncio loop made in the
warm-up would register one child's sockets in its siblings' epoll and steal
their wake-ups; a subprocess of the template would carry bytes from one
sandbox to another. A VM copies all of it with its RAM; here:

  inherited(own, outputs, console_fds)
                  what a child must copy, or None: taken in the fork server
                  once for all its children (one thread, nothing changes its
                  fds), and by a branch child itself right after the fork,
                  before it leaves its source's namespaces (the source's
                  other threads may have changed its fds since the request);
  rehome(plan, log)  in a child, single-threaded, in its own root and
                  network namespace: its own copies in their place, at the
                  same fd numbers (status flags, offsets, close-on-exec kept)
                  and the same mapping addresses. An fd that is no longer
                  what the list says is left alone; one that cannot be
                  copied is closed in the child (said in the log), never
                  left shared.

What becomes what:
  a file or directory on the root layer or /dev/shm   opened again by name
                                                      (the child's layer has
                                                      its own copy; /dev/shm
                                                      is copied by the caller),
                                                      each fd on its own: fds
                                                      that shared one offset
                                                      (os.dup) no longer do
  a file with no name (unlinked, O_TMPFILE, memfd)    a memfd with its bytes,
                                                      one per file for all the
                                                      fds that share it
  a shared mapping of those                           mapped from the copy
  shared anonymous memory (mmap(-1), System V)        copied to new shared memory
  a pipe                                              a new pipe with the bytes
                                                      queued in it (tee); an end
                                                      whose other end is not the
                                                      parent's reads EOF or
                                                      refuses writes: the
                                                      process behind it is not
                                                      in the child
  a Unix stream socket pair (both ends the parent's)  a new pair, queued bytes
                                                      copied
  an eventfd                                          a new one, same count
  an epoll instance                                   a new one with the same
                                                      registrations (on the
                                                      child's fds)
  any other directory, or a file on another mount     closed in the child: a
  (/proc, /run, /sys; a removed directory)            directory leads on (`..`,
                                                      /proc/<pid>/root of a
                                                      sibling) and /proc/self/mem
                                                      of the parent is its memory

  another fd of the parent's eval output pipes     the same of the child's
  (fds 1 and 2 while it runs evals)                   (outputs_to_own)

Left shared (see host/engine/process/README.md): fd 0 and other fds of the
host's console (the agent keeps its own: Console in forkling_agent.py), other sockets (a connection or a
listener has no copy to make), datagram and seqpacket pairs (their queued
messages cannot be read without taking them), timerfd, signalfd, inotify,
character devices (/dev/null: the sandbox binds its own in their place).
"""

import ctypes
import fcntl
import os
import socket
import stat
import struct
import termios

_libc = ctypes.CDLL(None, use_errno=True)

_MAP_SHARED, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_PROT = {'r': 1, 'w': 2, 'x': 4}
# (O_TMPFILE's files show O_DIRECTORY: added for directories only)
_REOPEN_FLAGS = (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DSYNC | os.O_SYNC | os.O_DIRECT
                 | os.O_NOATIME | os.O_PATH)
_SPLICE_F_NONBLOCK = 2
_EPOLL_CTL_ADD = 1
_SO_TYPE, _SO_DOMAIN = 3, 39
_MSG_PEEK, _MSG_DONTWAIT = 2, 0x40
_DELETED = ' (deleted)'
_EVENTFD, _EPOLL = 'anon_inode:[eventfd]', 'anon_inode:[eventpoll]'


def inherited(own, outputs, console_fds):
    """What a child must copy, or None when nothing (the usual case: a child
    then does nothing). `own`: the agent's fds, left alone. `outputs`:
    {(device, inode): 1 or 2} of the parent's eval output pipes (fds 1 and 2
    while it ran evals): other fds of them become the child's own fd 1 or 2
    (outputs_to_own()). `console_fds`: the agent's fds of the host's console
    (other fds of it are left shared, as fds 0-2 are). Each entry keeps
    the (device, inode) it was taken for: the child checks it still is.
    File systems are told apart by the device of their mount (fdinfo's mount
    id, in mountinfo): overlayfs's stat() reports the device of the layer a
    file lives on, and one file system can be mounted twice (a zygote's /tmp)."""
    sb = {}  # mount id -> device of its file system
    with open('/proc/self/mountinfo') as f:
        for line in f:
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[0].isdigit():
                sb[int(parts[0])] = parts[2]
    ours = {sb.get(_mount_of(path)) for path in ('/', '/dev/shm')} - {None}
    console = set()  # the host's pipes (fds 0-2, the agent's console), whatever other fds of them the warm-up made
    # (not fds 1 and 2 themselves when the agent has a console: they may be anything an eval put there)
    for fd in (0, *console_fds) if console_fds else (0, 1, 2):
        try:
            st = os.fstat(fd)
            console.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    named, unnamed = [], {}  # unnamed: (dev, ino) -> [fds], one copy each
    unnamed_paths = {}  # what /proc/self/maps calls an unnamed file -> its key
    named_paths = set()
    pipes, socks, eventfds, epolls, outs, closed = {}, {}, {}, [], [], []
    for name in os.listdir('/proc/self/fd'):
        fd = int(name)
        if fd in own or fd <= 2:
            continue
        try:
            st = os.fstat(fd)
            path = os.readlink('/proc/self/fd/%d' % fd)
        except OSError:
            continue  # the listing's own fd
        key = (st.st_dev, st.st_ino)
        mode = st.st_mode
        if key in outputs:  # (before the console: in a branch, fds 1 and 2 are its source's output pipes)
            outs.append((fd, key, outputs[key]))
        elif key in console:
            continue
        elif stat.S_ISFIFO(mode):
            pipes.setdefault(key, []).append(fd)
        elif stat.S_ISSOCK(mode):
            socks.setdefault(st.st_ino, []).append(fd)
        elif path == _EVENTFD:
            eventfds.setdefault(_fdinfo_field(fd, 'eventfd-id') or ('fd', fd), []).append(fd)
        elif path == _EPOLL:
            epolls.append(fd)
        elif stat.S_ISREG(mode) and (st.st_nlink == 0 or path.endswith(_DELETED)):
            unnamed.setdefault(key, []).append(fd)  # unlinked, O_TMPFILE, memfd: copied
            unnamed_paths[path] = key
        elif (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and path.startswith('/') and not path.endswith(_DELETED) \
                and sb.get(_mount_id(fd)) in ours:
            named.append((fd, key, path))  # opened again by name in the child's root
            named_paths.add(path)
        elif stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            closed.append((fd, key))  # another mount's, or a removed directory: never left shared
    pairs = []
    if socks:
        try:
            peers = _unix_peers()
        except (OSError, struct.error, ValueError):
            peers = {}  # no sock_diag here: pairs stay shared
        for ino, fds in socks.items():
            peer = peers.get(ino)
            if peer in socks and ino < peer:
                pairs.append((fds, socks[peer], ino, peer))
    maps = _shared_maps(unnamed, unnamed_paths, named_paths, ours, sb)
    try:
        shm = bool(os.listdir('/dev/shm'))
    except OSError:
        shm = False
    if not (named or unnamed or maps or shm or pipes or pairs or eventfds or epolls or outs or closed):
        return None
    return {'named': named, 'unnamed': list(unnamed.items()), 'maps': maps, 'shm': shm,
            'pipes': list(pipes.items()), 'pairs': pairs, 'eventfds': list(eventfds.values()), 'epolls': epolls,
            'outputs': outs, 'closed': closed}


def _shared_maps(unnamed, unnamed_paths, named_paths, ours, sb):
    maps = []
    with open('/proc/self/maps') as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5 or len(parts[1]) < 4 or parts[1][3] != 's':
                continue
            lo, hi = (int(x, 16) for x in parts[0].split('-'))
            major, minor = (int(x, 16) for x in parts[3].split(':'))
            key = (os.makedev(major, minor), int(parts[4]))
            path = parts[5].rstrip('\n') if len(parts) > 5 else ''
            prot = sum(_PROT[c] for c in parts[1][:3] if c in _PROT)
            if key not in unnamed and path in unnamed_paths:
                key = unnamed_paths[path]  # overlayfs: maps shows the layer's inode, fstat the overlay's
            if key in unnamed:
                how = ('copy of', key)
            elif path.startswith('/') and not path.endswith(_DELETED):
                if not (prot & 2 or path in named_paths) or sb.get(_mount_of(path)) not in ours:
                    continue  # read-only, of a file nobody here writes (gconv's cache); or not ours to copy
                how = ('path', path)
            else:
                how = ('anonymous', None)  # shared anonymous, System V, a removed file no fd holds
            maps.append((lo, hi - lo, prot, int(parts[2], 16), how))
    return maps


def _fdinfo(fd):
    with open('/proc/self/fdinfo/%d' % fd) as f:
        return f.read()


def _fdinfo_field(fd, field):
    try:
        for line in _fdinfo(fd).splitlines():
            k, _, v = line.partition(':')
            if k == field:
                return v.strip()
    except OSError:
        pass
    return None


def _mount_id(fd):
    v = _fdinfo_field(fd, 'mnt_id')
    return int(v) if v and v.isdigit() else None


def _mount_of(path):
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _mount_id(fd)
    finally:
        os.close(fd)


def _unix_peers():
    """{inode: peer's inode} of the Unix sockets of this network namespace
    (NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY dump with UDIAG_SHOW_PEER)."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4)
    try:
        s.settimeout(5)
        # unix_diag_req: family AF_UNIX, protocol, pad, all states, any inode, UDIAG_SHOW_PEER, no cookie
        req = struct.pack('=BBHIIIII', socket.AF_UNIX, 0, 0, 0xffffffff, 0, 4, 0xffffffff, 0xffffffff)
        s.sendto(struct.pack('=IHHII', 16 + len(req), 20, 0x301, 1, 0) + req, (0, 0))
        peers = {}
        while True:
            data = s.recv(1 << 16)
            if not data:
                return peers
            off = 0
            while off + 16 <= len(data):
                size, kind = struct.unpack_from('=IH', data, off)
                if size < 16 or kind == 3:  # NLMSG_DONE
                    return peers
                if kind == 2:  # NLMSG_ERROR
                    raise OSError(-struct.unpack_from('=i', data, off + 16)[0], 'sock_diag')
                end = min(off + size, len(data))
                if size >= 32 and end >= off + 24:  # nlmsghdr + unix_diag_msg (family, type, state, pad, inode, cookie)
                    ino = struct.unpack_from('=I', data, off + 20)[0]
                    a = off + 32
                    while a + 4 <= end:
                        alen, atype = struct.unpack_from('=HH', data, a)
                        if alen < 4:
                            break
                        if atype == 2 and alen >= 8 and a + 8 <= end:  # UNIX_DIAG_PEER
                            peers[ino] = struct.unpack_from('=I', data, a + 4)[0]
                        a += (alen + 3) & ~3
                off += (size + 3) & ~3
    finally:
        s.close()


def copy_bytes(src, dst):
    """All of src's bytes to dst (positional: src's offset stays)."""
    size = os.fstat(src).st_size
    off = 0
    while off < size:
        n = os.sendfile(dst, src, off, min(size - off, 1 << 30))
        if n == 0:
            break
        off += n


def rehome(plan, log):
    """In the child: see the module's docstring. Epoll instances last: their
    registrations name the other fds by number."""
    copies = {}  # (dev, ino) of an unnamed file -> a memfd with its bytes (for its fds and mappings)
    closing = [fd for fd, key in plan['closed'] if _is(fd, key)]
    if closing:
        _drop(closing, 'a directory, or a file of another mount than its root: nothing to copy it to', log)
    for key, fds in plan['unnamed']:
        fds = [fd for fd in fds if _is(fd, key)]
        if not fds:
            continue
        try:
            copies[key] = _copy_unnamed(fds[0])
        except OSError as e:
            _drop(fds, 'a copy of its bytes: %s' % e, log)
            continue
        for fd in fds:
            _guarded([fd], lambda fd=fd: _reopen(fd, '/proc/self/fd/%d' % copies[key]), log)
    for fd, key, path in plan['named']:
        if _is(fd, key):
            _guarded([fd], lambda fd=fd, path=path: _reopen(fd, path, copies_if_gone=True), log)
    if plan['maps']:
        _rehome_maps(plan['maps'], copies)
    for copy in copies.values():
        os.close(copy)
    for key, fds in plan['pipes']:
        fds = [fd for fd in fds if _is(fd, key)]
        if fds:
            _guarded(fds, lambda fds=fds: _rehome_pipe(fds, log), log)
    for a, b, a_ino, b_ino in plan['pairs']:
        a = [fd for fd in a if _ino(fd) == a_ino]
        b = [fd for fd in b if _ino(fd) == b_ino]
        if a and b:
            _guarded(a + b, lambda a=a, b=b: _rehome_pair(a, b), log)
    for fds in plan['eventfds']:
        fds = [fd for fd in fds if _link(fd) == _EVENTFD]
        if fds:
            _guarded(fds, lambda fds=fds: _rehome_eventfd(fds), log)
    for fd in plan['epolls']:
        if _link(fd) == _EPOLL:
            _guarded([fd], lambda fd=fd: _rehome_epoll(fd), log)


def outputs_to_own(plan, log):
    """In the child, once its fds 1 and 2 are its own eval output pipes:
    the other fds of its parent's (a warm-up's os.dup(1)) become copies of
    them (close-on-exec kept), so what goes through them is the child's output."""
    for fd, key, target in plan['outputs']:
        if _is(fd, key):
            _guarded([fd], lambda fd=fd, target=target: os.dup2(target, fd, inheritable=os.get_inheritable(fd)), log)


def _is(fd, key):
    """fd is still what the list says (a fork server's list is older than its children)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == key


def _ino(fd):
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _link(fd):
    try:
        return os.readlink('/proc/self/fd/%d' % fd)
    except OSError:
        return None


def _guarded(fds, fn, log):
    try:
        fn()
    except OSError as e:
        _drop(fds, str(e), log)


def _drop(fds, why, log):
    """Closed in the child rather than left shared with its parent."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    log('fork: could not give this sandbox its own copy of fd %s (%s): closed here' % (', '.join(map(str, fds)), why))


def _put(new, fd):
    """`new` at fd's number, with fd's close-on-exec and status flags (O_NONBLOCK, O_APPEND, ...)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    cloexec = fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    os.dup2(new, fd, inheritable=not cloexec)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _copy_unnamed(fd):
    """A memfd with the bytes of fd's file, read through /proc (fd may be write-only or O_PATH)."""
    src = os.open('/proc/self/fd/%d' % fd, os.O_RDONLY | os.O_CLOEXEC)
    try:
        copy = os.memfd_create('forkling-copy', os.MFD_CLOEXEC)
        try:
            copy_bytes(src, copy)
        except OSError:
            os.close(copy)
            raise
        return copy
    finally:
        os.close(src)


def _reopen(fd, path, copies_if_gone=False):
    """path opened with fd's access mode and flags, at fd's offset, in fd's place."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL) & _REOPEN_FLAGS
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        flags |= os.O_DIRECTORY
    copy = None
    try:
        try:
            new = os.open(path, flags | os.O_CLOEXEC)
        except PermissionError:
            new = os.open(path, (flags & ~os.O_NOATIME) | os.O_CLOEXEC)
        except FileNotFoundError:
            if not copies_if_gone or flags & os.O_DIRECTORY:
                raise
            # removed by name since the list was made (a fork server's is older): copied instead
            copy = _copy_unnamed(fd)
            new = os.open('/proc/self/fd/%d' % copy, flags | os.O_CLOEXEC)
    finally:
        if copy is not None:
            os.close(copy)
    try:
        if not flags & os.O_PATH:
            try:
                os.lseek(new, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
            except OSError:
                pass  # not seekable
        _put(new, fd)
    finally:
        os.close(new)


def _rehome_maps(maps, copies):
    C = ctypes
    mmap = _libc.mmap
    mmap.restype, mmap.argtypes = C.c_void_p, (C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long)
    mremap = _libc.mremap
    mremap.restype, mremap.argtypes = C.c_void_p, (C.c_void_p, C.c_size_t, C.c_size_t, C.c_int, C.c_void_p)
    mprotect = _libc.mprotect
    mprotect.argtypes = (C.c_void_p, C.c_size_t, C.c_int)
    failed = C.c_void_p(-1).value

    def check(addr, what):
        if addr is None or addr == failed:
            e = C.get_errno()
            raise OSError(e, 'shared mapping %s: %s' % (what, os.strerror(e)))
        return addr

    for lo, size, prot, offset, (how, arg) in maps:
        if how == 'anonymous' or (how == 'copy of' and arg not in copies):
            tmp = check(mmap(None, size, 3, _MAP_SHARED | _MAP_ANONYMOUS, -1, 0), 'copy')
            if not prot & 1 and mprotect(lo, size, prot | 1):
                check(None, 'read')
            C.memmove(tmp, lo, size)
            if mprotect(tmp, size, prot):
                check(None, 'protect')
            check(mremap(tmp, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, lo), 'move')
            continue
        path = arg if how == 'path' else '/proc/self/fd/%d' % copies[arg]
        fd = os.open(path, (os.O_RDWR if prot & 2 else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            check(mmap(lo, size, prot, _MAP_SHARED | _MAP_FIXED, fd, offset), path)
        finally:
            os.close(fd)


def _rehome_pipe(fds, log):
    """A new pipe in place of every end the parent held, with the bytes queued in it."""
    reads = [fd for fd in fds if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY]
    writes = [fd for fd in fds if fd not in reads]
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if reads:
            queued = struct.unpack('i', fcntl.ioctl(reads[0], termios.FIONREAD, struct.pack('i', 0)))[0]
            if queued > 0:
                try:
                    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, max(queued, fcntl.fcntl(reads[0], fcntl.F_GETPIPE_SZ)))
                except OSError:
                    pass
                tee = _libc.tee
                tee.restype, tee.argtypes = ctypes.c_ssize_t, (ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint)
                # One call: tee copies without taking, so a second one would start over.
                n = tee(reads[0], w, queued, _SPLICE_F_NONBLOCK)
                if n < queued:
                    log('fork: a pipe held %d bytes; %d of them copied into this sandbox' % (queued, max(n, 0)))
        for fd in reads:
            _put(r, fd)
        for fd in writes:
            _put(w, fd)
    finally:
        os.close(r)
        os.close(w)


def _sockopt(fd, opt):
    v, n = ctypes.c_int(0), ctypes.c_uint32(4)
    if _libc.getsockopt(fd, socket.SOL_SOCKET, opt, ctypes.byref(v), ctypes.byref(n)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return v.value


def _peek(fd):
    """The bytes queued at a socket, left there (no socket object: that would
    set the shared O_NONBLOCK under a default socket timeout)."""
    n = struct.unpack('i', fcntl.ioctl(fd, termios.FIONREAD, struct.pack('i', 0)))[0]
    if n <= 0:
        return b''
    buf = ctypes.create_string_buffer(n)
    got = _libc.recv(fd, buf, ctypes.c_size_t(n), _MSG_PEEK | _MSG_DONTWAIT)
    return buf.raw[:got] if got > 0 else b''


def _rehome_pair(a_fds, b_fds):
    """A new Unix stream socket pair in place of one whose ends the parent both held, with the bytes queued at each end."""
    family, kind = _sockopt(a_fds[0], _SO_DOMAIN), _sockopt(a_fds[0], _SO_TYPE)
    if kind != socket.SOCK_STREAM:
        return  # queued datagrams cannot be read without taking them: left shared
    x, y = socket.socketpair(family, kind)
    try:
        for src, peer in ((a_fds[0], y), (b_fds[0], x)):  # what waits at src was sent by its peer
            data = _peek(src)
            if data:
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(2 * len(data), peer.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)))
                peer.settimeout(1.0)
                peer.sendall(data)
        for fd in a_fds:
            _put(x.fileno(), fd)
        for fd in b_fds:
            _put(y.fileno(), fd)
    finally:
        x.close()
        y.close()


def _rehome_eventfd(fds):
    count = int(_fdinfo_field(fds[0], 'eventfd-count') or '0', 16)
    semaphore = _fdinfo_field(fds[0], 'eventfd-semaphore') == '1'
    new = os.eventfd(0, os.EFD_CLOEXEC | (os.EFD_SEMAPHORE if semaphore else 0))
    try:
        if count:
            os.eventfd_write(new, count)
        for fd in fds:
            _put(new, fd)
    finally:
        os.close(new)


class _EpollEvent(ctypes.Structure):
    _pack_ = 1  # packed on x86-64
    _fields_ = (('events', ctypes.c_uint32), ('data', ctypes.c_uint64))


def _rehome_epoll(fd):
    """A new epoll instance with the same registrations, now on the child's own fds."""
    entries = []
    for line in _fdinfo(fd).splitlines():
        f = line.split()
        if len(f) >= 6 and f[0] == 'tfd:' and f[2] == 'events:' and f[4] == 'data:':
            entries.append((int(f[1]), int(f[3], 16), int(f[5], 16)))
    create, ctl = _libc.epoll_create1, _libc.epoll_ctl
    ctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_EpollEvent))
    new = create(os.O_CLOEXEC)
    if new < 0:
        e = ctypes.get_errno()
        raise OSError(e, 'epoll_create1: %s' % os.strerror(e))
    try:
        for tfd, events, data in entries:
            ev = _EpollEvent(events, data)
            if ctl(new, _EPOLL_CTL_ADD, tfd, ctypes.byref(ev)) != 0:
                pass  # that fd is gone (closed since it was registered): nothing to watch
        _put(new, fd)
    finally:
        os.close(new)
