"""forkling_memfile: the process engine's template memory as a file, and
forks that give back the pages they copied but hold the template's bytes
again (forkling_reclaim.c does the work; this is its Python side).

The zygote calls remap() once, last thing before its first fork: its private
memory becomes a sealed memfd's, mapped MAP_PRIVATE where it was. Every fork
inherits that (and the state below); its service thread calls
when_idle() on each quiet tick, which gives back the fork's own pages equal
to the file once the sandbox has been idle 2 s since its last request.
Off unless the host sets FORKLING_PROCESS_RECLAIM=1 (the engine's option
`reclaim`, on by default).
"""

import ctypes
import errno
import mmap
import os

VERSION = 1  # forkling_reclaim.c's FR_VERSION
WAIT_MS = 200  # how long the other threads have to park
SCRATCH = 32 << 20  # room for /proc/self/smaps
STATE = {
    'lib': None,      # the loaded forkling_reclaim.so (None: off)
    'state': None,    # the mmap holding its struct fr_state (inherited by forks)
    'st': None,       # its address
    'fd': None,       # the file's fd (forks keep it: forkling_zygote counts it as the agent's own)
    'seen': -1,       # the agent's request count at the last tick
    'done_at': -1,    # ... and at the last reclaim
    'timeouts': 0,    # reclaims in a row that gave up: a thread did not park
    'quiet': 0,       # quiet ticks in a row, idle
}
MAX_TIMEOUTS = 3
# Quiet ticks (0.5 s each) before a reclaim: 2 s idle. Not sooner: a reclaim costs the CPU of a
# fraction of a fork, and the first children of a large fork would reclaim while the rest are made.
QUIET_TICKS = 4


def _load(log):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'forkling_reclaim.so')
    try:
        lib = ctypes.CDLL(path)
        if lib.fr_version() != VERSION:
            raise OSError('%s is version %d, not %d: rebuild it (npm run build:native)' % (path, lib.fr_version(), VERSION))
    except (OSError, AttributeError) as e:
        log('forks will not give back the pages they copied (more memory per child): %s' % e)
        return None
    for fn in (lib.fr_remap, lib.fr_reclaim, lib.fr_state_size, lib.fr_fd):
        fn.restype = ctypes.c_long
    lib.fr_fd.argtypes = (ctypes.c_void_p,)
    lib.fr_remap.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)
    lib.fr_reclaim.argtypes = (ctypes.c_void_p, ctypes.c_long)
    return lib


def remap(log):
    """In the zygote, once, after gc.freeze(): the template's memory made the file's.
    A failure leaves the process as it was (reclaim off)."""
    if os.environ.get('FORKLING_PROCESS_RECLAIM') != '1' or STATE['lib'] is not None:
        return
    lib = _load(log)
    if lib is None:
        return
    state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
    scratch = mmap.mmap(-1, SCRATCH, flags=mmap.MAP_PRIVATE)
    st = ctypes.addressof(ctypes.c_char.from_buffer(state))
    buf = ctypes.c_char.from_buffer(scratch)
    n = lib.fr_remap(st, ctypes.addressof(buf), SCRATCH, WAIT_MS)
    del buf
    scratch.close()
    if n < 0:
        log('forks will not give back the pages they copied: making the template memory a file failed: %s'
            % os.strerror(-n))
        state.close()
        return
    STATE.update(lib=lib, state=state, st=st, fd=lib.fr_fd(st))  # (n >= 0: some memory is the file's)


def after_fork():
    """In a new fork or branch, before sandbox code runs: an open file description of the
    file of its own (through /proc: the same file), so that siblings share no file offset
    or flags through it (a channel between sandboxes)."""
    fd = STATE['fd']
    if fd is None:
        return
    mine = os.open('/proc/self/fd/%d' % fd, os.O_RDONLY | os.O_CLOEXEC)
    os.dup2(mine, fd, inheritable=False)
    os.close(mine)


def own_fds():
    return {STATE['fd']} if STATE['fd'] is not None else set()


def when_idle(activity, idle, log):
    """A service thread's quiet tick: `activity` is the agent's count of client frames,
    `idle` whether nothing runs. Gives back once per quiet spell of QUIET_TICKS."""
    lib = STATE['lib']
    if lib is None:
        return
    STATE['quiet'] = STATE['quiet'] + 1 if activity == STATE['seen'] and idle else 0
    STATE['seen'] = activity
    if STATE['quiet'] < QUIET_TICKS or activity == STATE['done_at']:
        return
    STATE['done_at'] = activity
    n = lib.fr_reclaim(STATE['st'], WAIT_MS)
    if n >= 0:
        STATE['timeouts'] = 0
        return
    if n == -errno.ETIMEDOUT:  # a thread did not park (and the others waited WAIT_MS): next quiet spell, thrice
        STATE['timeouts'] += 1
        if STATE['timeouts'] < MAX_TIMEOUTS:
            return
    STATE['lib'] = None
    why = 'sandbox code has a handler for SIGRTMAX' if n == -errno.EEXIST else os.strerror(-n)
    log('this sandbox stops giving back the pages it copied: %s' % why)
