"""forkling_memfile: the process engine's template memory as a file, and
forks that give back the pages they copied but hold the template's bytes
again (forkling_reclaim.c does the work; this is its Python side).

The zygote calls remap() once, last thing before its first fork: its private
memory becomes a sealed memfd's, mapped MAP_PRIVATE where it was. Its fork
server calls it again once it is set up: what it wrote since becomes a
second file's, a layer over the first (a child's copy of one of those pages
goes back to the fork server's bytes). Every fork inherits that (and the
state below); its service thread calls
when_idle() on each quiet tick, which gives back the fork's own pages equal
to the file once the sandbox has been idle 2 s since its last request.
The template's pattern child (forkling_zygote._make_pattern) instead makes
its own memory one more file at its first quiet tick (when_idle: publishes); the fork
server takes it (adopt()), and a later fork's reclaim maps the pattern's
page over each of its copies that holds the same bytes.
Off unless the host sets FORKLING_PROCESS_RECLAIM=1 (the engine's option
`reclaim`, on by default).
"""

import ctypes
import errno
import mmap
import os

VERSION = 5  # forkling_reclaim.c's FR_VERSION
WAIT_MS = 200  # how long the other threads have to park
SCRATCH = 32 << 20  # room for /proc/thread-self/smaps
STATE = {
    'lib': None,      # the loaded forkling_reclaim.so (None: off)
    'state': None,    # the mmap holding its struct fr_state (inherited by forks)
    'st': None,       # its address
    'fds': (),        # the files' fds, oldest first (forks keep them: forkling_zygote counts them as the agent's own)
    'seen': -1,       # the agent's request count at the last tick
    'done_at': -1,    # ... and at the last reclaim
    'timeouts': 0,    # reclaims in a row that gave up: a thread did not park
    'quiet': 0,       # quiet ticks in a row, idle
    'tick_jitter_ms': 0,  # how much longer this fork's ticks are (after_fork: TICK_JITTER_MS)
    'pattern': False,  # the template's pattern child (forkling_zygote._make_pattern): publishes, once
    'published': None,  # ... what it made there: {'fd', 'runs', 'written'} (_published)
}
MAX_TIMEOUTS = 3
# Quiet ticks (0.5-1.25 s each: forkling_zygote.REAP_INTERVAL_MS plus jitter) before a reclaim: 2-5 s idle. Not sooner: a reclaim costs the CPU of a
# fraction of a fork, and the first children of a large fork would reclaim while the rest are made.
QUIET_TICKS = 4
# A fork's ticks are longer by up to this much, drawn per fork: forks made together go idle
# together, and reclaims at the same moment cost each about twice the CPU of one alone (10 forks
# of the numpy template on 2 cores, paired runs: 36-49 ms each at once, 22-29 ms spread; the same
# memory after). The same number of ticks, not more: each tick moves counters its pages hold away
# from the pattern's (6 more ticks left 40-60 KiB more per idle fork).
TICK_JITTER_MS = 750
# The pattern child publishes after as many (forkling_zygote ticks it faster): each tick
# moves counters a fork's pages hold (CPython's dict versions, its bytecode's warm-up counters),
# so the pattern is what a fork's memory is only after the same ticks.
PATTERN_FRAMES = 3  # ... and not before it has answered the zygote's hello, restore and eval


def _load(log):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'forkling_reclaim.so')
    try:
        lib = ctypes.CDLL(path)
        if lib.fr_version() != VERSION:
            raise OSError('%s is version %d, not %d: rebuild it (npm run build:native)' % (path, lib.fr_version(), VERSION))
        _declare(lib)
    except (OSError, AttributeError) as e:
        log('forks will not give back the pages they copied (more memory per child): %s' % e)
        return None
    return lib


def _declare(lib):
    """The types of the library's functions (AttributeError: one is missing)."""
    for fn in (lib.fr_remap, lib.fr_reclaim, lib.fr_reclaim_wait, lib.fr_state_size, lib.fr_files, lib.fr_fd, lib.fr_pattern, lib.fr_nruns, lib.fr_adopt, lib.fr_prefault, lib.fr_nwritten):
        fn.restype = ctypes.c_long
    lib.fr_runs.restype = lib.fr_written.restype = ctypes.c_void_p
    for fn in (lib.fr_files, lib.fr_pattern, lib.fr_runs, lib.fr_nruns, lib.fr_prefault, lib.fr_written, lib.fr_nwritten):
        fn.argtypes = (ctypes.c_void_p,)
    lib.fr_fd.argtypes = (ctypes.c_void_p, ctypes.c_long)
    lib.fr_adopt.argtypes = (ctypes.c_void_p, ctypes.c_long, ctypes.c_char_p, ctypes.c_long, ctypes.c_char_p, ctypes.c_long, ctypes.POINTER(ctypes.c_long))
    lib.fr_remap.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)
    lib.fr_reclaim.argtypes = (ctypes.c_void_p, ctypes.c_long)
    lib.fr_reclaim_wait.argtypes = (ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)


def remap(log, who='template'):
    """In the zygote, once, after gc.freeze(): the template's memory made a file's.
    In its fork server, once, set up: what it wrote since made another file's
    (or, if the zygote's failed, the first). A failure changes nothing."""
    if os.environ.get('FORKLING_PROCESS_RECLAIM') != '1':
        return
    lib = STATE['lib'] if STATE['lib'] is not None else _load(log)
    if lib is None:
        return
    state = STATE['state'] if STATE['state'] is not None else mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
    scratch = mmap.mmap(-1, SCRATCH, flags=mmap.MAP_PRIVATE)
    st = ctypes.addressof(ctypes.c_char.from_buffer(state))
    buf = ctypes.c_char.from_buffer(scratch)
    # Once per template, so worth a second and third try where a thread did not park in time (a
    # loaded host): a template without its file costs memory in every fork for its whole life.
    for wait_ms in (WAIT_MS, 4 * WAIT_MS, 16 * WAIT_MS):
        n = lib.fr_remap(st, ctypes.addressof(buf), SCRATCH, wait_ms)
        if n != -errno.ETIMEDOUT:
            break
    del buf
    scratch.close()
    if n < 0:
        log('forks will give back fewer of the pages they copied: making the memory of the %s a file failed: %s'
            % (who, os.strerror(-n)))
        if STATE['state'] is None:
            state.close()
        return
    STATE.update(lib=lib, state=state, st=st)
    STATE['fds'] = _file_fds()


RUN_BYTES = 24  # a struct fr_region: start, end, file offset


def whole_runs(x):
    """Whether x is bytes holding a whole number of struct fr_region."""
    return isinstance(x, bytes) and len(x) % RUN_BYTES == 0


def enabled():
    return STATE['lib'] is not None and STATE['st'] is not None


def _file_fds():
    """The fds of the files in the library's state, oldest first."""
    lib, st = STATE['lib'], STATE['st']
    return tuple(lib.fr_fd(st, i) for i in range(lib.fr_files(st)))


def _published(n, log):
    """In the pattern child, after its publish (fr_reclaim_wait's result n): what
    it made, for the zygote to fetch. One that gave up because a thread did not
    park (no file made yet) is tried again after another quiet spell; a third
    such, or any other failure, ends the child (the zygote sees it gone)."""
    lib, st = STATE['lib'], STATE['st']
    if n >= 0:
        STATE['pattern'] = False
        STATE['fds'] = _file_fds()
        STATE['published'] = {'fd': lib.fr_fd(st, lib.fr_files(st) - 1),
                              'runs': ctypes.string_at(lib.fr_runs(st), lib.fr_nruns(st) * RUN_BYTES),
                              'written': ctypes.string_at(lib.fr_written(st), lib.fr_nwritten(st) * RUN_BYTES)}
        return True
    STATE['timeouts'] += 1
    if n == -errno.ETIMEDOUT and STATE['timeouts'] < MAX_TIMEOUTS:  # (no file made: the zygote still waits for one)
        STATE['done_at'] = -1
        STATE['quiet'] = 0
        return False
    log('the pattern child could not make its file: %s' % os.strerror(-n))
    os._exit(1)  # (the zygote sees it gone)


def adopt(pid, fd, runs, written):
    """In the fork server: takes the pattern child `pid`'s file (its fd `fd`,
    opened again through /proc), runs and the pages it wrote (what it published,
    checked in C); every fork made from here on maps it over its own pages that
    equal it (fr_reclaim).
    Returns the file's length; raises OSError (nothing changed)."""
    if not enabled():
        raise OSError(errno.ENOSYS, 'no template file here (reclaim is off)')
    if not (whole_runs(runs) and whole_runs(written)):
        raise OSError(errno.EINVAL, 'runs: not a whole number of struct fr_region')
    lib, st = STATE['lib'], STATE['st']
    mine = os.open('/proc/%d/fd/%d' % (pid, fd), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # (never a FIFO's wait)
    n = lib.fr_adopt(st, mine, runs, len(runs) // RUN_BYTES, written, len(written) // RUN_BYTES, None)  # (forks of the Python loop copy nothing ahead)
    if n < 0:
        os.close(mine)
        raise OSError(-n, os.strerror(-n))
    STATE['fds'] = _file_fds()
    return n


def after_fork():
    """In a new fork or branch, before sandbox code runs: an open file description of each
    file of its own (through /proc: the same file), so that siblings share no file offset
    or flags through it (a channel between sandboxes)."""
    if enabled():  # (the files as its parent had them at the fork: a pattern the fork server took in C too)
        STATE['fds'] = _file_fds()
    STATE['tick_jitter_ms'] = int.from_bytes(os.urandom(2), 'little') % (TICK_JITTER_MS + 1)
    for fd in STATE['fds']:
        mine = os.open('/proc/self/fd/%d' % fd, os.O_RDONLY | os.O_CLOEXEC)
        os.dup2(mine, fd, inheritable=False)
        os.close(mine)


def own_fds():
    return set(STATE['fds'])


def when_idle(activity, idle, log, wait_fds=()):
    """A service thread's quiet tick: `activity` is the agent's count of client frames,
    `idle` whether nothing runs. Gives back once per quiet spell of QUIET_TICKS (a try that
    gave up because a thread did not park is made again QUIET_TICKS later). Returns whether
    nothing is left to give back until the next client frame: the caller may then sleep
    with no timeout. With wait_fds, a reclaim that does not fail sleeps in the same call
    (fr_reclaim_wait) until one of them is readable: no page is written in between."""
    STATE['quiet'] = STATE['quiet'] + 1 if activity == STATE['seen'] and idle else 0
    STATE['seen'] = activity
    lib = STATE['lib']
    if lib is None:
        return STATE['quiet'] > 0  # (nothing to give back: settled once a whole tick was quiet)
    if STATE['quiet'] < QUIET_TICKS:
        return False
    if activity == STATE['done_at']:
        return True
    if STATE['pattern'] and activity < PATTERN_FRAMES:
        return False  # (not before it has answered what the zygote sends it: hello, restore, eval)
    STATE['done_at'] = activity
    # One call for a fork and the pattern child alike: the pattern is what a fork's memory is at this point.
    fds = (ctypes.c_int * (2 * len(wait_fds)))(*[x for fd in wait_fds for x in (fd, 1)])  # struct pollfd: POLLIN
    n = lib.fr_reclaim_wait(STATE['st'], WAIT_MS, fds, len(wait_fds), STATE['pattern'])
    if STATE['pattern']:
        return _published(n, log)
    if n >= 0:
        STATE['timeouts'] = 0
        return True
    if n == -errno.ETIMEDOUT:  # a thread did not park (and the others waited WAIT_MS): again QUIET_TICKS later, thrice
        STATE['timeouts'] += 1
        if STATE['timeouts'] < MAX_TIMEOUTS:
            STATE['done_at'] = -1  # (a busy host, say, at the end of a large fork: not a whole idle spell lost)
            STATE['quiet'] = 0
            return False
    STATE['lib'] = None
    why = 'sandbox code has a handler for SIGRTMAX' if n == -errno.EEXIST else os.strerror(-n)
    log('this sandbox stops giving back the pages it copied: %s' % why)
    return True
