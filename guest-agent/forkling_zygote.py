"""forkling_zygote: fork() of the warm agent, for the process engine.

Where /dev/kvm is missing, a template is an agent that the host started as
PID 1 of new user, pid, mount, network, ipc, uts and cgroup namespaces (see
native/src/sandbox/launch.cc), with a seccomp filter, and warmed up with user
code. This module adds two ops to the agent:

  fork   (in the zygote) n children of the warm interpreter;
  branch (in a sandbox)  n children that continue from its live state.

Each child is fork() of the agent, made PID 1 of a new pid namespace
(unshare(CLONE_NEWPID) just before the fork, setns back just after), then
takes new mount, network, ipc and uts namespaces, a root of its own:
overlay(read-only base, private tmpfs upper), fresh /proc /dev /run, a new
hostname, its own Unix socket in /run/forkling (a host directory per
sandbox), and only then says it is ready. The host then runs `restore`.

The read-only base is an overlay with lower layers only (the zygote's upper
over the image): it can never become writable, so no sandbox can change what
its siblings see. A branch child copies its source's upper into its own.

A zygote does not fork its children itself: at its first fork it forks one
*fork server* (os.fork(), from one of its threads), which has a single thread
and so can fork each child with a plain fork() and none of CPython's
after-fork work (see _server_main), in a loop in C (forkling_spawn.c). The
zygote then makes the template's pattern (_make_pattern): the memory of a
child that answered a host's first requests, which idle forks map where
they wrote the same bytes (forkling_memfile, forkling_reclaim.c).

Only stdlib (ctypes) and the agent module; loaded by the agent if present.
"""

import _socket
import _thread
import ctypes
import errno
import fcntl
import gc
import os
import queue
import re
import select
import signal
import socket
import stat
import struct
import threading
import time
import traceback

import forkling_inherit
import forkling_memfile

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155
SYS_MKNOD = 133

LAYERS = '/run/forkling-layers'
SCRATCH = LAYERS + '/scratch'
BASE = LAYERS + '/base'
RUN = '/run/forkling'
ID_RE = re.compile(r'^[A-Za-z0-9_-]{1,32}$')
HOST_RE = re.compile(r'^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$')
READY_TIMEOUT_S = 30.0
# How long a new child waits for the host's first connection before it exits
# (the engine's option unclaimedForkS; the host checked it).
UNCLAIMED_S = float(os.environ.get('FORKLING_PROCESS_UNCLAIMED_S') or 2 * READY_TIMEOUT_S)

# What this process is: 'zygote' (started by the host), 'sandbox' (a child), or None (not the process engine).
ROLE = os.environ.get('FORKLING_PROCESS_ROLE')
STATE = {
    'frozen': False,   # the template's files are the read-only base overlay (lower of every child)
    'upper_fd': None,  # O_PATH fd of this sandbox's upper dir (copied by branch)
    'pidns_fd': None,  # this process's own pid namespace (to undo unshare(CLONE_NEWPID))
    'lifeline_fd': None,  # read end of the host's lifeline pipe (zygote, cold-booted sandbox)
    'server_pid_fd': None,  # in a fork server and its new children: a pidfd of the server (see _service)
    'wake_fd': None,   # in a sandbox: the eventfd a client frame wakes its sleeping service thread with
    'server': None,    # zygote: (pid, socket) of its fork server
    'in_server': None,  # in a fork server and its children: the server's end of its socket to the zygote
    'plan': None,      # the children's set-up steps (_setup_plan)
    'setup': None,     # in a child: where its set-up ran, 'c' (forkling_spawn.c) or 'python'
    'pattern': None,   # zygote: the thread making its fork server's pattern (_make_pattern)
    'pattern_fds': set(),  # zygote: that thread's fds (_pattern_fd)
    # 'inherited', in a fork server only: what its children copy (forkling_inherit), taken once
}
# Fork handlers the warm-up registers with os.register_at_fork (see register()).
AT_FORK = {'before': [], 'after_in_parent': [], 'after_in_child': []}
_lock = threading.Lock()  # one fork/branch at a time per process
_libc = ctypes.CDLL(None, use_errno=True)
# libc's fork() called with the GIL held and no Python before or after it
# (os.fork() runs CPython's at-fork work): only for a process with one thread.
_plain_fork = ctypes.PyDLL(None, use_errno=True).fork
_plain_fork.restype = ctypes.c_int
_plain_fork.argtypes = []
_agent_mod = None


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, '%s: %s' % (what, os.strerror(e)))


def mount(src, target, fstype, flags=0, data=None):
    _check(_libc.mount(src.encode() if src else None, target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), 'mount %s on %s' % (fstype or src, target))


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), 'unshare(%#x)' % flags)


def setns(fd, nstype):
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), 'setns')


# ------------------------------------------------------------------ registration

FORK_ARGS = {
    'type': 'object', 'required': ['children'],
    'properties': {
        'children': {'type': 'array', 'minItems': 0, 'maxItems': 1024, 'items': {
            'type': 'object', 'required': ['id', 'hostname'],
            'properties': {'id': {'type': 'string', 'minLength': 1, 'maxLength': 32},
                           'hostname': {'type': 'string', 'minLength': 1, 'maxLength': 63}}}},
    },
}


def register(agent_mod):
    """Adds the fork and branch ops (and their argument schemas) to the agent."""
    global _agent_mod
    _agent_mod = agent_mod
    # protocol/schema.ts has both ops; an agent built from an older schema gets them here.
    agent_mod.SCHEMA['ops'].setdefault('fork', {'args': FORK_ARGS, 'clientStream': False})
    agent_mod.SCHEMA['ops'].setdefault('branch', {'args': FORK_ARGS, 'clientStream': False})
    agent_mod.OPS['fork'] = op_fork
    agent_mod.OPS['branch'] = op_branch
    fd = os.environ.pop('FORKLING_LIFELINE_FD', None)
    if ROLE in ('zygote', 'sandbox') and fd is not None and fd.isdigit():
        # The host keeps the only write end: EOF means it is gone (or let us go).
        # We are PID 1 of our namespaces: when we exit, the kernel kills every
        # process in them, and so every fork of a zygote.
        STATE['lifeline_fd'] = int(fd)
        agent_mod.run_thread(_lifeline, int(fd), name='lifeline')
    if ROLE == 'zygote':
        os.register_at_fork = _register_at_fork


_os_register_at_fork = os.register_at_fork


def _register_at_fork(*, before=None, after_in_child=None, after_in_parent=None):
    """os.register_at_fork for the warm-up: the fork server forks without
    CPython's at-fork calls, so it runs these itself around each fork (the
    handlers of modules the agent imported before, threading's and random's,
    are not needed there: the server has one thread, and restore reseeds)."""
    given = {k: v for k, v in (('before', before), ('after_in_child', after_in_child),
                               ('after_in_parent', after_in_parent)) if v is not None}
    _os_register_at_fork(**given)  # checks the arguments; os.fork() (the server, branches) runs them
    for k, v in given.items():
        AT_FORK[k].append(v)


def _run_at_fork(which):
    for fn in reversed(AT_FORK[which]) if which == 'before' else AT_FORK[which]:
        try:
            fn()
        except Exception as e:  # as os.fork(): reported, not raised
            _agent_mod.log('at-fork handler %r failed: %r' % (fn, e))


def _lifeline(fd):
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    os._exit(1)


def _refuse(what):
    raise _agent_mod.OpError('bad_request', '%s works only in the process engine (%s)'
                             % (what, 'this is a sandbox: use branch' if ROLE == 'sandbox' else
                                'this is the zygote: use fork' if ROLE == 'zygote' else 'no zygote here'))


def op_fork(agent, conn, f):
    if ROLE != 'zygote':
        _refuse('fork')
    children = _check_children(f['children'])
    with _lock:
        _freeze_base()
        res = {'children': _server_fork(agent, children)}
    pattern = STATE['pattern']
    if not f['children'] and pattern is not None:  # (the engine's prepare(): the template ready, with its pattern)
        pattern.join(PATTERN_TIMEOUT_S)  # (longer, it goes on without us: later forks take it)
    return res


def op_branch(agent, conn, f):
    if ROLE != 'sandbox':
        _refuse('branch')
    children = _check_children(f['children'])
    held = None
    if f.get('hold') is True:  # each child waits to be placed (HOLD_SIGNAL) before it copies anything
        def held(ch, pid):
            conn.send({'t': 'ev', 'id': f['id'], 'ev': 'forked', 'child': ch['id'], 'pid': pid})
    with _lock:
        return {'children': _spawn(agent, children, branch=True, fork=os.fork, held=held)}


def _check_children(children):
    """The children asked for, checked, as {id, hostname} only (no flag of ours, such as a pattern's)."""
    seen = set()
    for ch in children:
        if not ID_RE.match(ch['id']) or ch['id'] in seen:
            raise _agent_mod.OpError('bad_request', 'child id %r: use 1-32 of A-Z a-z 0-9 _ - , unique' % ch['id'])
        if not HOST_RE.match(ch['hostname']):
            raise _agent_mod.OpError('bad_request', 'hostname %r is not a valid host name' % ch['hostname'])
        seen.add(ch['id'])
    return [{'id': ch['id'], 'hostname': ch['hostname']} for ch in children]


# ------------------------------------------------------------------ the zygote's base


def _image_layers():
    """The image as overlay lower layers (top first): without root, the skeleton
    of its directories above it (host/engine/process/skeleton.ts: directories we own)."""
    skeleton = LAYERS + '/skeleton'
    return [skeleton, LAYERS + '/image'] if os.path.isdir(skeleton) else [LAYERS + '/image']


def _base_layers():
    """The read-only layers (top first) under the writable upper of each fork
    or branch: the template's files (BASE, once the zygote froze them) over
    the image's. Each is its own lower layer, not one overlay of them all:
    overlayfs stacks at most two deep, and an image in a store that is itself
    on overlayfs (a container's root) is one deep already."""
    return ([BASE] if os.path.ismount(BASE) else []) + _image_layers()


def _freeze_base():
    """Once, before the first fork: the template's files (the zygote's upper)
    become the read-only base, and the interpreter's objects move to the
    permanent GC generation so that the collector in a child does not touch
    (and copy) every inherited page."""
    if STATE['frozen']:
        return
    os.makedirs(BASE, exist_ok=True)
    os.makedirs(SCRATCH, exist_ok=True)
    # An overlay without an upper of its own, not a bind of the upper: root in a sandbox could make
    # a bind writable again (it made it, in its own user namespace), an overlay without upper never
    # is. (An overlay needs two lower layers when it has no upper: the second is empty.)
    os.makedirs(LAYERS + '/empty', exist_ok=True)
    mount('overlay', BASE, 'overlay', MS_RDONLY | MS_NOSUID | MS_NODEV,
          'lowerdir=%s,userxattr' % ':'.join([LAYERS + '/upper', LAYERS + '/empty']))
    # (no fd of it is kept: forks inherit fds, and `..` from a directory fd walks the mount
    # tree it was opened in, the zygote's, even after a fork's own pivot_root)
    STATE['frozen'] = True
    STATE['pidns_fd'] = os.open('/proc/self/ns/pid', os.O_RDONLY | os.O_CLOEXEC)
    try:
        _rehearse(_agent_mod.AGENT)
    except Exception as e:  # an optimisation only
        _agent_mod.log('zygote rehearsal failed: %r' % e)
    gc.collect()
    gc.freeze()
    forkling_memfile.remap(_agent_mod.log)  # (last: what forks share from here on is the file's)
    if os.environ.get('FORKLING_PROCESS_KSM') == '1':
        _ksm_opt_in()


PR_SET_MEMORY_MERGE = 67


def _ksm_opt_in():
    """Marks every anonymous page of the zygote mergeable by KSM (Linux >= 6.4),
    inherited by each fork. Most pages a child makes private end up identical
    to the zygote's (a refcount back where it was) or to every sibling's (the
    same first writes in each child); where the host runs KSM
    (/sys/kernel/mm/ksm/run = 1) they are shared again. Opt-in: merged pages
    are a timing side channel between sandboxes (see the README)."""
    rc = _libc.prctl(ctypes.c_int(PR_SET_MEMORY_MERGE), ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if rc != 0:
        _agent_mod.log('zygote: PR_SET_MEMORY_MERGE failed: %s (no KSM sharing)' % os.strerror(ctypes.get_errno()))


class _Client:
    """A client of an agent over a stream socket, as the host is (frames: a
    4-byte length, then msgpack)."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.last = 0

    def send(self, op, **args):
        import msgpack
        self.last += 1
        payload = msgpack.packb(dict(args, t='req', id=self.last, op=op), use_bin_type=True)
        self.sock.sendall(struct.pack('>I', len(payload)) + payload)
        return self.last

    def answer(self, i):
        """The answer (res or err frame) to request i; other frames are passed over."""
        import msgpack
        buf = self.buf
        while True:
            while len(buf) < 4 or len(buf) < 4 + struct.unpack('>I', buf[:4])[0]:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise OSError('the agent closed the connection')
                buf.extend(chunk)
            n = struct.unpack('>I', buf[:4])[0]
            f = msgpack.unpackb(bytes(buf[4:4 + n]), raw=False)
            del buf[:4 + n]
            if f.get('id') == i and f.get('t') in ('res', 'err'):
                return f

    def call(self, op, **args):
        return self.answer(self.send(op, **args))


def _rehearse(agent, rounds=24):
    """Runs what every child will run first (hello, restore, eval, ping over a
    connection) in the zygote before it is frozen: lazy imports, caches and
    the interpreter's specialised bytecode are then filled in once, here,
    instead of being written (and copied page by page) in every child."""
    if agent is None:
        return
    a, b = socket.socketpair()
    conn = _agent_mod.Connection(agent, a, 'zygote-rehearsal')
    agent.connections.add(conn)
    _agent_mod.run_thread(conn.run, name='rehearsal')
    client = _Client(b)
    try:
        b.settimeout(10)
        for _ in range(rounds):
            for op, args in (('hello', {'versions': [1]}), ('restore', {'entropy': os.urandom(64)}),
                             ('eval', {'code': '1 + 1', 'context': 'forkling-rehearsal'}), ('ping', {})):
                client.call(op, **args)
        agent.contexts.pop('forkling-rehearsal', None)
    finally:
        b.close()
        conn.close()


# ------------------------------------------------------------------ fork


# ------------------------------------------------------------------ the fork server


def _server_fork(agent, children):
    """The zygote's side: hands the request to its fork server (started at the
    first fork, and again if it has died) and returns its answer."""
    if STATE['server'] is not None and _server_gone(STATE['server'][1]):
        _drop_server()  # it died while idle (killed for memory, say): a new one below
    if STATE['server'] is None:
        _start_server(agent)
        if forkling_memfile.enabled():
            STATE['pattern'] = threading.Thread(target=_make_pattern, args=(STATE['server'],), name='pattern', daemon=True)
            STATE['pattern'].start()
    res = _server_call(_pack_fork(children))
    if isinstance(res, bytes):
        try:
            return _unpack_answer(res, children)
        except (struct.error, ValueError) as e:
            _drop_server()  # (out of step)
            res = e
    why = 'the fork server exited' if res is None else 'the fork server failed: %s' % res
    if not children:  # (the engine's prepare: an error is the only way to say so; the next fork starts another)
        raise OSError(errno.EIO, why)
    return [{'id': ch['id'], 'ok': False, 'error': why} for ch in children]


PATTERN_TIMEOUT_S = 10.0


def _make_pattern(server):
    """In the zygote, in a thread of its own, for a new fork server: the
    template's pattern. One more child of the server, which no user ever
    sees, answers what the host asks of every new sandbox first (hello and
    restore together, then an eval) over its own socket, as the host would;
    idle, it makes its memory a file where each fork gives back its copies
    (forkling_memfile.when_idle: publish), and the fork server takes that
    file for every later fork (adopt). Most pages a fork writes at first it
    writes as this child did, byte for byte, at the same addresses: an idle
    fork then maps the pattern's page over each such copy, so one copy
    serves every fork. The pattern holds only the template's memory and
    what our agent wrote: no user code ran in it. Forks made before it is
    taken go without. An optimisation only: a failure is logged."""
    name = os.urandom(6).hex()  # (a sandbox id as the host makes them: the same length, the same allocations)
    t0 = time.monotonic()
    why, pidfd, res = None, None, None
    try:
        with _lock:
            if STATE['server'] is not server:
                return
            child = {'id': name, 'hostname': name, 'pattern': True}
            res = _server_call(_pack_fork([child]))
        res = _unpack_answer(res, [child])[0] if isinstance(res, bytes) else {'error': res or 'the fork server exited'}
        if not res.get('ok'):
            raise OSError('its child failed: %s' % res['error'])
        pid = res['pid']
        # (it waits for us: alive; killed through this fd, never by a number used again)
        pidfd = _pattern_fd(lambda: os.pidfd_open(pid))
        made = _drive_pattern(pid, name)
        with _lock:
            if STATE['server'] is not server:
                return
            res = _server_call(_pack_adopt(pid, made['fd'], made['runs'], made['written']))
        res, ahead = struct.unpack('=qq', res) if isinstance(res, bytes) and len(res) == 16 else (res, 0)
        if not isinstance(res, int) or res < 0:
            raise OSError('the fork server did not take it: %s' % (os.strerror(-res) if isinstance(res, int) else res or 'it exited'))
    except Exception as e:  # noqa: BLE001 - an optimisation: said on the console, forks go on
        why = '%s: %s' % (type(e).__name__, e)
    finally:
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # (the server reaps it)
            except OSError:
                pass
            _pattern_close(pidfd)
    if why is not None:
        _agent_mod.log('no pattern for this template\'s forks (more memory per fork): %s' % why)
    else:
        _agent_mod.log('pattern for forks: %d KiB in %.0f ms; each fork copies %d KiB ahead'
                       % (res >> 10, (time.monotonic() - t0) * 1000, ahead * 4 if _prefaults() else 0))


def _prefaults():
    """Whether the fork server's forks copy ahead the pages the pattern child wrote
    (forkling_reclaim's fr_prefault; the engine's option prefault; the C loop only)."""
    return forkling_memfile.enabled() and os.environ.get('FORKLING_PROCESS_PREFAULT') != '0'


def _drive_pattern(pid, name):
    """The host's first requests to the pattern child; then waits until it has
    published (idle: a file of its own more, or it exited) and fetches what it made."""
    s = socket.socket(fileno=_pattern_fd(lambda: _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM).detach()))
    try:
        s.settimeout(PATTERN_TIMEOUT_S)
        before = _memfds(pid)  # (before its requests: it may publish soon after the last answer)
        s.connect('/proc/%d/root%s/agent.sock' % (pid, RUN))
        client = _Client(s)
        hello = client.send('hello', versions=[1], client='forkling-host')
        restore = client.send('restore', entropy=os.urandom(64), hostname=name, sandboxId=name)
        for i in (hello, restore, client.send('eval', code='1 + 1')):
            f = client.answer(i)
            if f['t'] != 'res':
                raise OSError('%s: %s' % (f.get('code'), f.get('message')))
        deadline = time.monotonic() + PATTERN_TIMEOUT_S
        while _memfds(pid) == before:  # (no request meanwhile: it would not be idle)
            if time.monotonic() > deadline:
                raise OSError('it did not publish within %ds' % PATTERN_TIMEOUT_S)
            time.sleep(0.02)
        # (its file is there once it has begun: what it made, once it is done)
        f = client.call('eval', code='import time, forkling_memfile as m\nwhile m.STATE["published"] is None: time.sleep(0.01)\n'
                        'm.STATE["published"]', context='forkling-pattern', timeoutMs=int(PATTERN_TIMEOUT_S * 1000))
        made = f.get('value') if f['t'] == 'res' else None
        if not (isinstance(made, dict) and isinstance(made.get('fd'), int)
                and forkling_memfile.whole_runs(made.get('runs')) and forkling_memfile.whole_runs(made.get('written'))):
            raise OSError('publish: %s' % (made or f.get('message')))
        return made
    finally:
        _pattern_close(s.detach())


def _memfds(pid):
    """How many fds of the template's files process pid has (raises OSError once it is gone)."""
    n = 0
    for fd in os.listdir('/proc/%d/fd' % pid):
        try:
            n += os.readlink('/proc/%d/fd/%s' % (pid, fd)).startswith('/memfd:forkling-template')
        except OSError:
            pass
    return n


def _pattern_fd(make):
    """An fd of the pattern thread's, made under _lock and listed in STATE: a fork server
    forked from this zygote meanwhile closes it first thing (_server_main), so no sandbox
    inherits a connection to the pattern child or its pidfd."""
    with _lock:
        fd = make()
        STATE['pattern_fds'].add(fd)
    return fd


def _pattern_close(fd):
    with _lock:
        STATE['pattern_fds'].discard(fd)
        os.close(fd)


def _start_server(agent):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            a.close()
            _server_main(agent, b)
        except BaseException:  # noqa: BLE001 - said on the console, then the zygote answers "exited"
            _agent_mod.log('the fork server failed:\n%s' % traceback.format_exc())
        finally:
            os._exit(1)
    b.close()
    STATE['server'] = (pid, a)


def _server_call(msg):
    """A request to the fork server and its answer; on a broken stream (its
    end, or an exception: returned) the server is dropped."""
    pid, sock = STATE['server']
    try:
        _send_msg(sock, msg)
        res = _recv_msg(sock)
    except BaseException as e:  # noqa: BLE001 - (MemoryError mid-message too: the stream is out of step)
        res = e
    if res is None or isinstance(res, BaseException):
        _drop_server()
    return res


def _server_gone(sock):
    """An idle fork server sends nothing: its socket readable or hung up means it has exited."""
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLHUP)
    return bool(p.poll(0))


def _drop_server():
    """Forgets the fork server (killed, if it still runs: its stream is no longer in step)."""
    pid, sock = STATE['server']
    STATE['server'] = None
    sock.close()
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# The fork server's messages (see forkling_spawn.c, which serves them in C; _server_main's
# loop in Python where it cannot): a length, then a kind and its body, host byte order.
FS_FORK, FS_ADOPT = 1, 2
FS_READY, FS_CALL_FAILED, FS_CHILD_FAILED, FS_TIMED_OUT, FS_NOT_FORKED = range(5)
FS_PATTERN = 1  # a child's flag: the template's pattern child
FS_TEXT = 512  # what the server keeps of a child's message


def _pack_fork(children):
    out = [struct.pack('=II', FS_FORK, len(children))]
    for ch in children:
        i, h = ch['id'].encode(), ch['hostname'].encode()
        out.append(bytes((len(i),)) + i + bytes((len(h),)) + h + bytes((FS_PATTERN if ch.get('pattern') else 0,)))
    return b''.join(out)


def _unpack_fork(msg):
    """The children of an FS_FORK message (the Python loop's side); ValueError if it is not one."""
    n, at, out = struct.unpack_from('=I', msg, 4)[0], 8, []
    for _ in range(n):
        i = msg[at + 1:at + 1 + msg[at]]
        at += 1 + len(i)
        h = msg[at + 1:at + 1 + msg[at]]
        at += 1 + len(h)
        out.append({'id': i.decode(), 'hostname': h.decode(), 'pattern': msg[at] == FS_PATTERN})
        at += 1
    if at != len(msg):
        raise ValueError('a fork request of %d bytes, not %d' % (len(msg), at))
    return out


def _pack_adopt(pid, fd, runs, written):
    return struct.pack('=IiiII', FS_ADOPT, pid, fd, len(runs) // 24, len(written) // 24) + runs + written


def _pack_answer(results):
    """The Python loop's answer to FS_FORK: each result ready, or failed with its text."""
    out = [struct.pack('=I', len(results))]
    for r in results:
        text = b'' if r['ok'] else r['error'].encode()[:FS_TEXT]
        out.append(struct.pack('=iiiiq', r.get('pid', 0), FS_READY if r['ok'] else FS_CHILD_FAILED, 0, len(text),
                               int(r.get('setupMs', 0) * 1e6)) + text)
    return b''.join(out)


def _unpack_answer(data, children):
    """The fork server's answer to FS_FORK for `children`, as the op fork's results."""
    if struct.unpack_from('=I', data)[0] != len(children):
        raise ValueError('an answer for %d children, not %d' % (struct.unpack_from('=I', data)[0], len(children)))
    at, failed, out = 4, None, []
    for ch in children:
        pid, status, err, n, setup_ns = struct.unpack_from('=iiiiq', data, at)
        text = data[at + 24:at + 24 + n].decode('utf-8', 'replace')
        at += 24 + n
        if status == FS_READY:
            out.append({'id': ch['id'], 'ok': True, 'pid': pid, 'setupMs': setup_ns / 1e6})
            continue
        if status == FS_CALL_FAILED:
            error = failed = 'fork: %s: %s' % (text, os.strerror(err))  # (EAGAIN at the pids limit, ENOMEM, EMFILE)
        elif status == FS_CHILD_FAILED:
            error = text or 'child exited during set-up'
        elif status == FS_TIMED_OUT:
            error = 'not ready within %ds' % READY_TIMEOUT_S
        else:
            error = 'not forked: %s' % (failed or 'the fork server could not go back to its pid namespace')
        out.append({'id': ch['id'], 'ok': False, 'error': error})
    return out


def _send_msg(sock, data):
    sock.sendall(struct.pack('=I', len(data)) + data)


def _recv_msg(sock):
    """One message, or None at EOF."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    body = _recv_exact(sock, struct.unpack('=I', head)[0])
    if body is None:
        raise ValueError('truncated message')
    return body


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ValueError('truncated message')
            return None
        buf += chunk
    return bytes(buf)


REAP_INTERVAL_MS = 500
PATTERN_TICK_MS = 50


def _server_main(agent, sock):
    """The fork server: os.fork() of the zygote (so CPython's after-fork work
    ran once, here), with one thread. It forks every child of the template
    with libc's fork() called directly: a copy of a process that has one
    thread needs none of CPython's after-fork repairs (no other thread can hold
    the GIL, a lock or the import lock, or own a thread state), and skipping
    them keeps each child from writing (and so copying) ~750 KiB of pages at
    once (~280 KiB less in the end: later work touches some of them anyway).
    The agent's state is reset here once, so children start from it as is.
    After its set-up it serves in C (_serve_in_c): its memory then stays as
    it is for every fork, so no child holds a copy of a page it wrote for an
    earlier request, and each matches the template's pattern."""
    global _lock, ROLE
    STATE['in_server'] = sock
    _lock = threading.Lock()  # the zygote held it across the fork
    for fd in STATE['pattern_fds']:  # (the zygote's pattern thread's: not ours, nor our children's)
        os.close(fd)
    STATE['pattern_fds'] = set()
    _close_lifeline()  # we end with the zygote (PID 1 of our pid namespace)
    if getattr(agent, 'after_fork_child', None) is None:
        _reset_agent(agent)
    os.environ['FORKLING_PROCESS_ROLE'] = 'sandbox'  # what every child is
    ROLE = 'sandbox'
    STATE['server_pid_fd'] = os.pidfd_open(os.getpid())
    gc.collect()  # (a full collection also empties the free lists of tuples, floats, ...)
    _agent_mod.fill_pool_holes()
    plan = _setup_plan()  # in the fresh pools, made once for every child
    if _spawn_lib() is not None:
        _c_steps(plan)
    gc.freeze()  # what this process made goes out of the children's collector's way too
    # What children share from here on is a file's, as the zygote's (a child's copy of a page
    # this process wrote goes back to its bytes). Before `inherited`: the file's fd is our own.
    forkling_memfile.remap(_agent_mod.log, 'fork server')
    # Once, after the collection (whose finalizers may close files): one thread, no user code.
    # The warm-up's at-fork handlers may still change fds: each child checks every entry.
    STATE['inherited'] = forkling_inherit.inherited(_own_fds(agent), _output_keys(agent), _console_fds(agent))
    if not any(AT_FORK.values()) and not (STATE['inherited'] and STATE['inherited']['shm']) \
            and len(os.listdir('/proc/self/task')) == 1 and _spawn_lib() is not None:
        _serve_in_c(agent, sock)  # (returns only where it cannot serve at all)
    # In Python: the warm-up left at-fork handlers or files in /dev/shm, or no C library here.
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        ready = poller.poll(REAP_INTERVAL_MS)
        _reap_children()
        if not ready:
            continue
        msg = _recv_msg(sock)
        if msg is None:
            os._exit(0)  # the zygote closed its end
        if struct.unpack_from('=I', msg)[0] == FS_ADOPT:
            _send_msg(sock, struct.pack('=qq', _adopt(msg), 0))  # (its forks copy no page ahead: fr_prefault)
            continue
        # One thread, unless an at-fork handler of the warm-up started one: then os.fork().
        fork = _fork_child if len(os.listdir('/proc/self/task')) == 1 else os.fork
        _send_msg(sock, _pack_answer(_spawn(agent, _unpack_fork(msg), branch=False, fork=fork)))


def _serve_in_c(agent, sock):
    """The fork server's loop in C (forkling_spawn.c's fs_serve): its memory
    stays as it is now for every fork. Never returns in the server (it exits
    when the zygote closes its end); in a new child, goes on as that child."""
    arr, steps = _c_steps(STATE['plan'])
    mf = forkling_memfile.STATE
    serve = _Serve(sock=sock.fileno(), pidns_fd=STATE['pidns_fd'], steps=ctypes.addressof(arr), nsteps=len(steps),
                   ready_timeout_ms=int(READY_TIMEOUT_S * 1000), reap_ms=REAP_INTERVAL_MS,
                   adopt=ctypes.cast(mf['lib'].fr_adopt, ctypes.c_void_p).value if forkling_memfile.enabled() else None,
                   prefault=ctypes.cast(mf['lib'].fr_prefault, ctypes.c_void_p).value if _prefaults() else None,
                   st=mf['st'])
    i = _SPAWN['serve'](ctypes.byref(_SPAWN['libc']), ctypes.byref(serve))
    if i == -errno.EPIPE:
        os._exit(0)  # the zygote closed its end
    if i < 0:
        if i == -errno.ENOSYS:
            return  # (not x86-64: the loop in Python)
        raise OSError(-i, "the fork server's loop: %s" % os.strerror(-i))
    ch = {'id': serve.id.decode(), 'hostname': serve.hostname.decode(), 'pattern': bool(serve.flags & FS_PATTERN)}
    done = (_step_error(steps[serve.step_failed], serve.err) if serve.step_failed >= 0 else None, serve.keep_fd)
    _child_main(agent, ch, serve.ready_w, False, STATE['inherited'], done)  # never returns


def _adopt(msg):
    """The Python loop's FS_ADOPT: fr_adopt's result (the file's length, or -errno)."""
    pid, fd, n, nw = struct.unpack_from('=iiII', msg, 4)
    runs, written = msg[20:20 + n * 24], msg[20 + n * 24:]
    if len(msg) != 20 + (n + nw) * 24:
        return -errno.EPROTO
    try:
        return forkling_memfile.adopt(pid, fd, runs, written)
    except OSError as e:
        return -(e.errno or errno.EIO)


def _fork_child():
    """fork() for a process with one thread, with the warm-up's at-fork handlers."""
    _run_at_fork('before')
    pid = _plain_fork()
    if pid < 0:
        e = ctypes.get_errno()
        _run_at_fork('after_in_parent')
        raise OSError(e, os.strerror(e))
    _run_at_fork('after_in_child' if pid == 0 else 'after_in_parent')
    return pid


def _reap_children():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ------------------------------------------------------------------ fork


def _spawn(agent, children, branch, fork, held=None):
    _setup_plan()  # here, once: every child inherits it
    inherited = None if branch else STATE.get('inherited')  # (a branch child takes its own: _child_main)
    if STATE['pidns_fd'] is None:
        STATE['pidns_fd'] = os.open('/proc/self/ns/pid', os.O_RDONLY | os.O_CLOEXEC)
    results = {}
    if held is not None:  # (blocked in this thread across the forks: a child takes it with sigtimedwait)
        signal.pthread_sigmask(signal.SIG_BLOCK, {HOLD_SIGNAL})
    try:
        pending = _fork_in_python(agent, children, branch, fork, inherited, results, held)
    finally:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {HOLD_SIGNAL})
    return _wait_ready(pending, results, children)


# A held branch child (the host's `hold`) waits for this signal, which the host sends once it
# has moved the child into its own cgroup: what the child then copies (its source's writable
# layer, shared memory) is charged to its own memory limit, not its source's. (SIGRTMAX is
# forkling_reclaim's; SIGRTMAX - 1 is unused by glibc and CPython.)
HOLD_SIGNAL = signal.SIGRTMAX - 1


def _fork_in_python(agent, children, branch, fork, inherited, results, held=None):
    """Forks each child in turn (fork: os.fork, or _fork_child); returns [(child, pid, ready pipe, t0)].
    held(child, pid): each child forked waits for HOLD_SIGNAL first; called once it is forked."""
    # What this process runs between two forks, and after the last, makes
    # its pages a copy of its own, so the child forked before keeps the
    # original alone (private memory): little Python here, none of it new.
    pending = []
    failed = None  # a fork failed (EAGAIN: pids limit, ENOMEM): it and the rest fail, the forked ones go on
    for ch in children:
        if failed is not None:
            results[ch['id']] = {'id': ch['id'], 'ok': False, 'error': 'not forked: %s' % failed}
            continue
        r, w = os.pipe()
        t0 = time.monotonic()
        # The next child is PID 1 of a new pid namespace; undone right after the fork.
        try:
            unshare(CLONE_NEWPID)
            try:
                pid = fork()
            except BaseException:
                setns(STATE['pidns_fd'], CLONE_NEWPID)
                raise
        except OSError as e:
            os.close(r)
            os.close(w)
            failed = 'fork: %s' % (e.strerror or e)
            results[ch['id']] = {'id': ch['id'], 'ok': False, 'error': failed}
            continue
        if pid != 0:
            setns(STATE['pidns_fd'], CLONE_NEWPID)
        else:
            for _, _, other_r, _ in pending:  # earlier siblings' ready pipes are not ours to read
                os.close(other_r)
            os.close(r)
            _child_main(agent, ch, w, branch, inherited, held=held is not None)  # never returns
        os.close(w)
        pending.append((ch, pid, r, t0))
        if held is not None:
            held(ch, pid)
    return pending


_LIBC_FNS = ('fork', 'unshare', 'setns', 'pipe2', 'close', 'socket', 'ioctl', 'clock_gettime', '__errno_location')


class _Libc(ctypes.Structure):  # struct fs_libc
    _fields_ = [(n, ctypes.c_void_p) for n in _LIBC_FNS]


class _Step(ctypes.Structure):  # struct fs_step
    _fields_ = [('kind', ctypes.c_long), ('fn', ctypes.c_void_p), ('args', ctypes.c_long * 5)]


class _Child(ctypes.Structure):  # struct fs_child
    _fields_ = [('hostname', ctypes.c_char_p), ('hostname_len', ctypes.c_long), ('start_ns', ctypes.c_long)] + [
        (n, ctypes.c_int) for n in ('pid', 'ready_r', 'ready_w', 'keep_fd', 'step_failed', 'failed_call', 'err', 'flags')] + [
        ('id', ctypes.c_char_p)]


class _Serve(ctypes.Structure):  # struct fs_serve
    _fields_ = [('sock', ctypes.c_int), ('pidns_fd', ctypes.c_int), ('steps', ctypes.c_void_p), ('nsteps', ctypes.c_long),
                ('ready_timeout_ms', ctypes.c_long), ('reap_ms', ctypes.c_long), ('adopt', ctypes.c_void_p),
                ('prefault', ctypes.c_void_p), ('st', ctypes.c_void_p), ('index', ctypes.c_long)] + [
        (n, ctypes.c_int) for n in ('flags', 'ready_w', 'keep_fd', 'step_failed', 'err', 'pad_')] + [
        ('id', ctypes.c_char * 40), ('hostname', ctypes.c_char * 72)]


SPAWN_VERSION = 4  # forkling_spawn.c's FS_VERSION: the structures above match its own
_SPAWN = {}  # 'lib': fs_spawn (or None: not built), 'serve': fs_serve, 'libc': a _Libc


def _spawn_lib():
    """forkling_spawn.c's fs_spawn (and fs_serve), built next to this file (native/build.mjs), or None."""
    if 'lib' not in _SPAWN:
        _SPAWN['lib'] = None
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'forkling_spawn.so')
        try:
            lib = ctypes.PyDLL(path)  # (PyDLL: the GIL stays held across fork(), as in os.fork())
            if lib.fs_version() != SPAWN_VERSION:
                raise OSError('%s is version %d, not %d: rebuild it (npm run build:native)' % (path, lib.fs_version(), SPAWN_VERSION))
            sizes = (ctypes.c_long * 4)()
            lib.fs_sizes(sizes)
            if list(sizes) != [ctypes.sizeof(t) for t in (_Libc, _Step, _Child, _Serve)]:
                raise OSError('%s: its structures are not ours (sizes %s): rebuild it (npm run build:native)' % (path, list(sizes)))
            fn = lib.fs_spawn
            fn.restype = ctypes.c_int
            fn.argtypes = (ctypes.POINTER(_Libc), ctypes.c_int, ctypes.POINTER(_Child), ctypes.c_int, ctypes.POINTER(_Step), ctypes.c_int)
            _SPAWN['serve'] = lib.fs_serve
            _SPAWN['serve'].restype = ctypes.c_long
            _SPAWN['serve'].argtypes = (ctypes.POINTER(_Libc), ctypes.POINTER(_Serve))
            _SPAWN['libc'] = _Libc(*[ctypes.cast(_libc[n], ctypes.c_void_p).value for n in _LIBC_FNS])
        except (OSError, AttributeError) as e:
            _agent_mod.log('forks are set up in Python (each costs more memory): %s' % e)
            return None
        _SPAWN['lib'] = fn
    return _SPAWN['lib']


def _c_steps(plan):
    """The plan as struct fs_step[] (made once per plan; the plan keeps the byte strings it points to)."""
    if 'c_steps' not in plan:
        steps = plan['before_layer'] + plan['after_layer'] + plan['pivot']
        arr = (_Step * len(steps))()
        for i, (kind, addr, args, _) in enumerate(steps):
            arr[i].kind = kind
            arr[i].fn = addr
            for j, a in enumerate(args):
                arr[i].args[j] = ctypes.cast(ctypes.c_char_p(a), ctypes.c_void_p).value if isinstance(a, bytes) else (a or 0)
        plan['c_steps'] = (arr, steps)
    return plan['c_steps']


def _wait_ready(pending, results, children):
    # Wait until every child listens (or fails): a byte string on its pipe, then EOF.
    poller = select.poll()
    waiting = {}
    for ch, pid, r, t0 in pending:
        poller.register(r, select.POLLIN)
        waiting[r] = [ch, pid, t0, b'']
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting:
        left = deadline - time.monotonic()
        events = poller.poll(int(left * 1000) + 1) if left > 0 else []
        if not events:
            for r, (ch, pid, _, _) in waiting.items():
                _kill(pid)
                results[ch['id']] = {'id': ch['id'], 'ok': False, 'error': 'not ready within %ds' % READY_TIMEOUT_S}
                os.close(r)
            break
        for r, _ in events:
            child = waiting[r]
            data = os.read(r, 4096)
            if data:
                child[3] += data
                if child[3] != b'ok':
                    continue
                # ready: not waiting for the end of file (a process the child forked may hold the pipe)
            del waiting[r]
            poller.unregister(r)
            os.close(r)
            ch, pid, t0, msg = child
            if msg == b'ok':
                results[ch['id']] = {'id': ch['id'], 'ok': True, 'pid': pid,
                                     'setupMs': (time.monotonic() - t0) * 1000.0}
            else:
                _kill(pid)
                results[ch['id']] = {'id': ch['id'], 'ok': False,
                                     'error': msg.decode('utf-8', 'replace') or 'child exited during set-up'}
    return [results[ch['id']] for ch in children]


def _kill(pid):
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _child_main(agent, ch, w, branch, inherited, done=None, held=False):
    """In the new child (PID 1 of its pid namespace): set up (unless done, in
    C: (error or None, fd of the new upper)), listen, say ok on w, serve.
    held: first wait until the host has placed it (HOLD_SIGNAL)."""
    global _lock
    if held:
        placed = signal.sigtimedwait({HOLD_SIGNAL}, READY_TIMEOUT_S)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {HOLD_SIGNAL})
        if placed is None:
            os.write(w, b'not placed in its cgroup by the host within %ds' % READY_TIMEOUT_S)
            os._exit(1)
    server_sock, STATE['in_server'] = STATE['in_server'], None
    if server_sock is not None:  # forked by the fork server, which reset the agent already
        os.close(server_sock.detach())  # the server's, not ours: the zygote must see EOF when the server is gone
    else:  # a branch: os.fork() of a sandbox
        _lock = threading.Lock()  # the parent held it across the fork
        _close_lifeline()
        fd, STATE['server_pid_fd'] = STATE['server_pid_fd'], None  # (its source's, until its service thread closed it)
        if fd is not None:
            os.close(fd)
    try:
        if branch:  # here, in the copy, before its own namespaces: exactly what it has, whatever the source's threads did since
            inherited = forkling_inherit.inherited(_own_fds(agent) | {w}, _output_keys(agent), _console_fds(agent))
        STATE['setup'] = 'python' if done is None else 'c'
        if done is None:
            new_upper = _setup_child(ch, branch, inherited)
        elif done[0] is not None:
            raise done[0]
        else:
            new_upper = done[1]
        _after_setup(ch, new_upper, inherited)
        forkling_memfile.STATE['pattern'] = ch.get('pattern') is True
        _rebuild_agent(agent, ch, reset=server_sock is None, inherited=inherited)
        _listen(agent, RUN + '/agent.sock')
        os.write(w, b'ok')
        os.close(w)
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        try:
            os.write(w, ('%s: %s' % (type(e).__name__, e)).encode()[:4000])
        finally:
            os._exit(1)
    try:
        agent.eval_loop()
    finally:
        os._exit(0)


def _own_fds(agent):
    """The agent's fds that a child must not copy (forkling_inherit): STATE's,
    the fork server's socket, the console and the eval output pipes (which
    the child releases)."""
    own = {v for k, v in STATE.items() if k.endswith('_fd') and isinstance(v, int)} | forkling_memfile.own_fds()
    if STATE['in_server'] is not None:
        own.add(STATE['in_server'].fileno())
    own |= set(_console_fds(agent))
    cap = getattr(agent, 'fd_capture', None)
    if cap is not None:
        own |= cap.own_fds()
    return own


def _output_keys(agent):
    """{(device, inode): 1 or 2} of the agent's eval output pipes, released or not (forkling_inherit)."""
    cap = getattr(agent, 'fd_capture', None)
    return dict(cap.keys) if cap is not None else {}


def _console_fds(agent):
    """The agent's fds of the console: other fds of it are left shared (forkling_inherit)."""
    console = getattr(agent, 'console', None)
    return list(console.fds.values()) if console is not None else []


def _close_lifeline():
    """A child lives in its parent's pid namespace and ends with it: the
    parent's lifeline (watched by a thread the child does not have) is not its own."""
    fd, STATE['lifeline_fd'] = STATE['lifeline_fd'], None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


# A set-up step is (kind, libc function's address, arguments, what): the call fails when
# it returns < 0, and errno says why. Run by _run_steps here (a branch), or by
# forkling_spawn.c (the fork server's children): one plan, the same calls.
STEP_CALL, STEP_HOSTNAME, STEP_LO_UP, STEP_KEEP_FD = 0, 1, 2, 3  # (as in forkling_spawn.c)
_STEP_FN = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 5), use_errno=True)  # (every step returns an int)


def _step(name, *args, what=None, kind=STEP_CALL):
    if what is None:
        what = '%s %s' % (name, args[0].decode()) if args and isinstance(args[0], bytes) else name
    return (kind, ctypes.cast(_libc[name], ctypes.c_void_p).value, args, what)


def _setup_plan():
    """The child's namespace and mount set-up as libc calls with their
    arguments, made once per process (the fork server, or a sandbox at its
    first branch): a child then runs a loop of system calls, not the Python
    that builds their arguments (fewer objects touched, fewer pages copied).
    Sections: before_layer, (a branch copies its source's upper here),
    after_layer (with the child's host name), (a copy of /dev/shm, where the
    warm-up left files in it), pivot (which keeps an fd of the new upper)."""
    if STATE['plan'] is not None:
        return STATE['plan']
    # A source sandbox has no SCRATCH until its first branch: made here, every child's copy of our mounts has it.
    os.makedirs(SCRATCH, exist_ok=True)
    scratch = SCRATCH.encode()
    upper, work, root = scratch + b'/upper', scratch + b'/work', scratch + b'/root'
    # A fork's lower layers are the zygote's frozen base over the image's; a
    # sandbox booted straight from the image (no zygote) branches on the image's.
    layers = [x.encode() for x in _base_layers()]
    dev = root + b'/dev'
    before_layer = [
        # A session of its own: kill(0, SIGKILL) in its parent's process group would reach
        # the zygote, the fork server and every sibling (a process group ignores pid namespaces).
        _step('setsid'),
        _step('unshare', CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
        _step('mount', None, b'/', None, MS_REC | MS_PRIVATE, None, what='mount --make-rprivate /'),
        _step('mount', b'tmpfs', scratch, b'tmpfs', MS_NOSUID | MS_NODEV, b'mode=0755', what='mount tmpfs on ' + SCRATCH),
        _step('mkdir', upper, 0o755),
        _step('mkdir', work, 0o755),
        _step('mkdir', root, 0o755),
    ]
    # By path, not through a directory fd: overlay clones its lower mount, which must
    # be in this mount namespace (an fd still names the parent's).
    after_layer = [
        _step('mount', b'overlay', root, b'overlay', MS_NOSUID | MS_NODEV,
              b'lowerdir=%s,upperdir=%s,workdir=%s,userxattr' % (b':'.join(layers), upper, work), what='mount the overlay root'),
        _step('mount', b'tmpfs', root + b'/run', b'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC, b'mode=0755,size=16m', what='mount /run'),
        _step('mkdir', root + RUN.encode(), 0o755),
        _step('mkdir', root + LAYERS.encode(), 0o755),
        _step('mkdir', root + SCRATCH.encode(), 0o755),
    ]
    # What this sandbox's branches build on, at the same paths: read-only (BASE has no upper; the
    # image and its skeleton are locked read-only by the host's binds).
    for layer in layers:
        after_layer += [
            _step('mkdir', root + layer, 0o755),
            _step('mount', layer, root + layer, None, MS_BIND, None, what='bind the base layer ' + layer.decode()),
        ]
    after_layer += [
        _step('mount', b'proc', root + b'/proc', b'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC, None, what='mount /proc'),
        _step('mount', b'tmpfs', dev, b'tmpfs', MS_NOSUID | MS_NOEXEC, b'mode=0755,size=64k', what='mount /dev'),
    ]
    for name in (b'null', b'zero', b'full', b'random', b'urandom', b'tty'):
        # (the system call: glibc exports mknod() only since 2.33)
        after_layer.append(_step('syscall', SYS_MKNOD, dev + b'/' + name, stat.S_IFREG | 0o666, 0, what='mknod /dev/' + name.decode()))
        after_layer.append(_step('mount', b'/dev/' + name, dev + b'/' + name, None, MS_BIND, None, what='bind /dev/' + name.decode()))
    after_layer += [
        _step('mkdir', dev + b'/pts', 0o755),
        _step('mount', b'devpts', dev + b'/pts', b'devpts', MS_NOSUID | MS_NOEXEC, b'newinstance,ptmxmode=0666,mode=0620', what='mount /dev/pts'),
        _step('mkdir', dev + b'/shm', 0o755),
        _step('mount', b'tmpfs', dev + b'/shm', b'tmpfs', MS_NOSUID | MS_NODEV, b'mode=1777', what='mount /dev/shm'),
    ]
    for target, link in ((b'pts/ptmx', b'ptmx'), (b'/proc/self/fd', b'fd'), (b'/proc/self/fd/0', b'stdin'),
                         (b'/proc/self/fd/1', b'stdout'), (b'/proc/self/fd/2', b'stderr')):
        after_layer.append(_step('symlink', target, dev + b'/' + link, what='symlink /dev/' + link.decode()))
    after_layer += [
        _step('mount', b'tmpfs', root + b'/sys', b'tmpfs', MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, b'size=4k,mode=0555', what='mount /sys'),
        _step('sethostname', kind=STEP_HOSTNAME, what='sethostname'),
        (STEP_LO_UP, None, (), 'lo up'),
    ]
    pivot = [
        _step('open', upper, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, kind=STEP_KEEP_FD),
        _step('chdir', root),
        _step('syscall', SYS_PIVOT_ROOT, b'.', b'.', what='pivot_root'),
        _step('umount2', b'.', MNT_DETACH, what='umount the old root'),
        _step('chdir', b'/'),
    ]
    STATE['plan'] = plan = {'before_layer': before_layer, 'after_layer': after_layer, 'pivot': pivot, 'root': root, 'upper': upper}
    return plan


SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
LO_IFREQ = struct.pack('16sh14x', b'lo', 0)


def _lo_up():
    """`lo` up in the child's new network namespace (IFF_UP is bit 0 of the flags' low byte)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        req = bytearray(LO_IFREQ)
        fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)
        req[16] |= 1
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, req)
    finally:
        s.close()


def _step_error(step, err):
    return OSError(err, '%s: %s' % (step[3], os.strerror(err)))


def _run_steps(steps, hostname):
    """Runs steps in this process; returns what a STEP_KEEP_FD step returned (or None)."""
    kept = None
    for step in steps:
        kind, addr, args, _ = step
        if kind == STEP_LO_UP:
            _lo_up()
            continue
        if kind == STEP_HOSTNAME:
            args = (hostname, len(hostname))
        rc = _STEP_FN(addr)(*args, *(None,) * (5 - len(args)))
        if rc < 0:
            raise _step_error(step, ctypes.get_errno())
        if kind == STEP_KEEP_FD:
            kept = rc
    return kept


def _setup_child(ch, branch, inherited):
    """The child's set-up in Python (a branch; or a fork the fork server could not make in C):
    returns an O_PATH fd of its new upper."""
    plan = _setup_plan()
    hostname = ch['hostname'].encode()
    _run_steps(plan['before_layer'], hostname)
    if branch:
        copy_tree('/proc/self/fd/%d' % STATE['upper_fd'] if STATE['upper_fd'] is not None else LAYERS + '/upper',
                  plan['upper'].decode())
    _run_steps(plan['after_layer'], hostname)
    if inherited is not None and inherited['shm']:
        copy_tree('/dev/shm', plan['root'].decode() + '/dev/shm')  # the parent's, still reachable here
    return _run_steps(plan['pivot'], hostname)


def _after_setup(ch, new_upper, inherited):
    """In the child, after its set-up (in Python or in C): its new root is /."""
    if inherited is not None:
        forkling_inherit.rehome(inherited, _agent_mod.log)
    if STATE['upper_fd'] is not None:
        os.close(STATE['upper_fd'])
    STATE['upper_fd'] = new_upper
    os.close(STATE['pidns_fd'])
    STATE['pidns_fd'] = os.open('/proc/self/ns/pid', os.O_RDONLY | os.O_CLOEXEC)
    STATE['plan'] = None  # made again, for this sandbox's own mounts, at its first branch
    os.environ['FORKLING_SANDBOX_ID'] = ch['id']  # (FORKLING_PROCESS_ROLE is sandbox already)
    forkling_memfile.after_fork()


def _rebuild_agent(agent, ch, reset, inherited):
    """Readies the agent in the child, which has only this thread; in a
    branch, first drops the parent's sockets and state (a fork server did
    that once for all its children). Its service threads start in _listen
    and, for eval output and timeouts, at first use (_StartingEvent)."""
    rebuild = getattr(agent, 'after_fork_child', None)
    if rebuild is not None:
        rebuild()
    else:
        if reset:
            _reset_agent(agent)
        agent.main_ident = threading.get_ident()
        agent.t0 = time.monotonic()
    agent.sandbox_id = ch['id']
    cap = getattr(agent, 'fd_capture', None)
    if cap is not None:  # our own eval output pipes, read by _service
        try:
            cap.open()
        except OSError as e:
            _agent_mod.log('output of subprocesses in evals is not captured: %s' % e)
        if inherited is not None:  # (to the console if there is no capture: never the parent's pipes)
            forkling_inherit.outputs_to_own(inherited, _agent_mod.log)


def _reset_agent(agent):
    """Drops the parent's sockets without shutting them down (that would cut
    the parent's connections), forgets its processes and evals, and makes new
    locks and events (the parent's may have been held across the fork)."""
    for conn in list(agent.connections):
        conn.closed = True
        try:
            conn.sock.close()
        except OSError:
            pass
    agent.connections = set()
    agent.conn_handoff = queue.SimpleQueue()
    agent.conn_parked = 0  # the parent's parked thread is not in this process
    agent.conn_lock = threading.Lock()
    for s in agent.listeners:
        try:
            s.close()
        except OSError:
            pass
    agent.listeners = []
    agent.procs = {}
    agent.procs_lock = threading.Lock()
    agent.eval_queue = queue.SimpleQueue()
    agent.eval_lock = threading.Lock()
    agent.eval_waiting = []
    agent.running = None
    agent.interrupt_for = None
    agent.output_sink = None
    agent.flush_wakeup = _StartingEvent(agent._flusher)
    agent.watch_wakeup = _StartingEvent(agent._watchdog)
    agent.stopping = False
    cap = getattr(agent, 'fd_capture', None)
    if cap is not None:  # the parent's eval output pipes: fds 1 and 2 are the console until ours (_rebuild_agent)
        cap.release()  # (its keys stay, for the fork server's forkling_inherit.inherited)
        cap.lock = threading.RLock()  # the parent's reader may have held it across the fork
    if agent.random_fd is not None:
        try:
            os.close(agent.random_fd)
        except OSError:
            pass
        agent.random_fd = None


class _StartingEvent(threading.Event):
    """The agent's wake-up event of its output flusher or its eval watchdog,
    whose first set() starts that loop: a child that never prints from an
    eval nor gives one a timeout runs neither thread."""

    def __init__(self, loop):
        super().__init__()
        self._loop = loop
        self._once = _thread.allocate_lock()  # taken by the first set(), never released

    def set(self):
        if self._once.acquire(False):
            try:
                _bare_thread(self._loop)
            except BaseException:
                self._once.release()  # (no thread now, at the pids limit: the next set() tries again)
                raise
        super().set()


def _bare_thread(target, *args):
    """The agent's threads in a child, without threading.Thread: no Thread
    object, locks and start handshake (a context switch) per thread, fewer
    pages written in the child. They never ask threading who they are."""
    _thread.start_new_thread(target, args)


def _listen(agent, path):
    """Listens on `path` (in this sandbox's own /run, which the host reaches through
    /proc/<pid>/root) and
    starts the child's one service thread."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.bind(path)
    s.listen(128)
    agent.listeners.append(s)
    fd, STATE['wake_fd'] = STATE['wake_fd'], None  # (a branch's: its source's)
    if fd is not None:
        os.close(fd)
    agent.service_asleep = False
    STATE['wake_fd'] = agent.service_wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    _bare_thread(_service, agent, s)


def _service(agent, lsock):
    """A child's service thread, in place of the agent's accept loop and
    reaper threads: accepts connections (each read by a thread of its own,
    as in the agent) and, as PID 1, reaps orphans every REAP_INTERVAL_MS,
    and only looks through /proc when a child of ours has exited. Once the
    sandbox is idle and has given back its copies (forkling_memfile), with
    no zombie left to reap, it sleeps with no timeout until a connection,
    output, a client frame (agent.service_wake_fd) or the exit of a child
    process (a pidfd of each: forkling_agent.sleep_kids) comes: each tick would write
    ~100 KiB of the pages just given back again."""
    poller = select.poll()
    watched = []  # what poller has, for a sleep in C (forkling_memfile.when_idle)

    def watch(fd):
        poller.register(fd, select.POLLIN)
        watched.append(fd)

    def unwatch(fd):
        poller.unregister(fd)
        watched.remove(fd)
    watch(lsock.fileno())
    wake = STATE['wake_fd']
    watch(wake)
    # A new fork dies with its fork server until the host connects (it does once
    # the server has answered for it): a server that dies in the middle of a
    # request (killed for memory in the zygote's cgroup, say) leaves no child
    # behind that the host never heard of. A pidfd, not PR_SET_PDEATHSIG: that
    # one is per thread, and a server gone before it was set would be missed.
    server = STATE['server_pid_fd']
    if server is not None:
        watch(server)
    cap = getattr(agent, 'fd_capture', None)  # fds 1 and 2: read here, no thread of their own
    for fd in cap.streams if cap is not None else ():
        watch(fd)
    listener = lsock.fileno()
    seen = set()
    # A child the host never connects to (it gave up on the request after the answer) goes by itself.
    # It does not tick until the host connects (nothing to reap or give back yet): a fork of many
    # waits seconds for the last of them, and each tick would move counters its pages hold away
    # from the pattern's (see forkling_memfile.QUIET_TICKS).
    unclaimed_until = time.monotonic() + UNCLAIMED_S
    # (the pattern child ticks faster: its ticks, not their length, make its memory a fork's)
    # (a fork's own length: forks made together reclaim apart, forkling_memfile.TICK_JITTER_MS)
    tick = PATTERN_TICK_MS if forkling_memfile.STATE['pattern'] else REAP_INTERVAL_MS + forkling_memfile.STATE['tick_jitter_ms']
    timeout = int(UNCLAIMED_S * 1000) + 1
    kids = []  # pidfds of our child processes while asleep: each wakes us when it exits
    while not agent.stopping:
        events = poller.poll(timeout)
        agent.service_asleep = False
        timeout = tick
        for fd in kids:
            poller.unregister(fd)
            os.close(fd)
        kids = []
        ready = {fd for fd, _ in events}
        if wake in ready:
            try:
                os.eventfd_read(wake)
            except OSError:
                pass
        if cap is not None and not ready.isdisjoint(cap.streams):
            for fd, ev in events:
                if ev & select.POLLNVAL and fd in cap.streams:  # closed under the agent: read no more
                    unwatch(fd)
                    _agent_mod.log('eval output: a pipe of fds 1 and 2 was closed under the agent; not read any more')
            cap.drain_logged()
        if unclaimed_until is not None and listener not in ready:
            left = unclaimed_until - time.monotonic()
            if server in ready or left < 0:
                os._exit(1)  # the server is gone, or the host never came
            timeout = int(left * 1000) + 1
            continue
        if listener in ready:
            unclaimed_until = None
            if server is not None:  # the host's first connection: ours for good
                unwatch(server)
                os.close(server)
                server = STATE['server_pid_fd'] = None
            try:
                fd, _ = lsock._accept()
            except OSError as e:
                if agent.stopping or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listener is closed
                time.sleep(0.01)  # ECONNABORTED, EMFILE, ...: keep accepting
                continue
            sock = conn = None
            try:
                sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, fd)
                conn = _agent_mod.Connection(agent, sock, 'unix')
                agent.connections.add(conn)
                _bare_thread(conn.run)
            except Exception as e:  # no thread (pids limit), no memory: this connection only; the service goes on
                if conn is not None:
                    agent.connections.discard(conn)
                if sock is not None:
                    sock.close()  # (its object owns fd: closed once, never again when it is collected)
                else:
                    os.close(fd)
                _agent_mod.log('connection refused: %s: %s' % (type(e).__name__, e))
        if _agent_mod.IS_PID1:
            seen = _agent_mod.reap_tick(seen)
        if not events:  # a quiet tick: once the sandbox has been idle a whole one, its copies equal to the template's go
            kids = _agent_mod.sleep_kids(agent) if unclaimed_until is None else None
            sleep = kids is not None
            settled = forkling_memfile.when_idle(agent.frames, agent.idle(), _agent_mod.log, watched + kids if sleep else ())
            if sleep and settled:
                timeout = -1
                agent.service_asleep = True  # (again: a reclaim that slept was woken, maybe by a frame that cleared it)
                for fd in kids:
                    poller.register(fd, select.POLLIN)
            else:
                for fd in kids or ():
                    os.close(fd)
                kids = []


# ------------------------------------------------------------------ branch: copy a layer


def copy_tree(src, dst):
    """Copies an overlay upper dir: files, dirs, symlinks, whiteouts (0/0
    character devices), owners, modes, times, xattrs (user.overlay.* mark
    opaque dirs), hard links kept as links."""
    links = {}

    def attrs(s, d, st, is_link):
        try:
            os.chown(d, st.st_uid, st.st_gid, follow_symlinks=False)
        except OSError:
            pass
        if not is_link:
            os.chmod(d, stat.S_IMODE(st.st_mode))
            try:
                for name in os.listxattr(s, follow_symlinks=False):
                    os.setxattr(d, name, os.getxattr(s, name, follow_symlinks=False), follow_symlinks=False)
            except OSError as e:
                if e.errno not in (errno.ENOTSUP, errno.EPERM):
                    raise
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    def walk(s_dir, d_dir):
        with os.scandir(s_dir) as it:
            entries = list(it)
        for e in entries:
            s, d = e.path, os.path.join(d_dir, e.name)
            st = e.stat(follow_symlinks=False)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                os.mkdir(d, 0o700)
                walk(s, d)
                attrs(s, d, st, False)
            elif stat.S_ISLNK(mode):
                os.symlink(os.readlink(s), d)
                attrs(s, d, st, True)
            elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
                os.link(links[(st.st_dev, st.st_ino)], d)
            elif stat.S_ISREG(mode):
                with open(s, 'rb') as fs, open(d, 'wb') as fd:
                    forkling_inherit.copy_bytes(fs.fileno(), fd.fileno())
                attrs(s, d, st, False)
                if st.st_nlink > 1:
                    links[(st.st_dev, st.st_ino)] = d
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
                os.mknod(d, mode, st.st_rdev)
                attrs(s, d, st, False)
            # sockets: bound names of the source's servers; meaningless in the copy

    walk(src, dst)
    st = os.stat(src)
    attrs(src, dst, st, False)
