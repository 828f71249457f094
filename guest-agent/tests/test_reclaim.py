"""forkling_reclaim.c: a process's private memory made a sealed file's
(fr_remap) while other threads write, and forks that give back their pages
equal to that file (fr_reclaim) while their threads write: no write is lost,
the memory reads the same, pages come back, and no sandbox can change the
file. Needs the built library (npm run build:native); x86-64."""

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SO = os.path.join(os.path.dirname(HERE), 'forkling_reclaim.so')
PAGE = 4096


def private_kib():
    """Private_Dirty: the copies this process holds alone (a file page it alone maps again after a
    drop is Private_Clean, though the file holds it for every process of the template)."""
    with open('/proc/self/smaps_rollup') as f:
        return sum(int(line.split()[1]) for line in f if line.startswith('Private_Dirty'))


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def apart(pages, fill):
    """A private anonymous mapping of pages + 1 whose first page is made read-only: kept apart
    from what is mapped next to it (adjacent anonymous mappings merge, and the state and
    scratch fr_remap is given are left out with whatever merged with them). Its other pages are
    filled with `fill` (None: untouched but the first). Returns the address of the first of them."""
    at = LIBC.mmap(None, (pages + 1) * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    ctypes.memset(at + PAGE, 0x0c if fill is None else fill, PAGE if fill is None else pages * PAGE)
    if LIBC.mprotect(at, PAGE, mmap.PROT_READ) != 0:
        raise OSError(ctypes.get_errno(), 'mprotect')
    return at + PAGE


def maps_entry(at):
    """The fields of the /proc/self/maps line of the mapping holding address `at`, or None."""
    with open('/proc/self/maps') as f:
        for line in f:
            parts = line.split()
            a, b = (int(x, 16) for x in parts[0].split('-'))
            if a <= at < b:
                return parts
    return None


def mapping_of(at):
    """(permissions, path) of the mapping holding address `at`."""
    parts = maps_entry(at)
    return None if parts is None else (parts[1], parts[5] if len(parts) > 5 else '')


def file_page(at):
    """Whether the page at `at` is (after a read) a file's page, not a copy of this process's."""
    ctypes.string_at(at, 1)
    with open('/proc/self/pagemap', 'rb') as f:
        f.seek(at // PAGE * 8)
        return bool(int.from_bytes(f.read(8), 'little') >> 61 & 1)


def file_kib(fd):
    return os.fstat(fd).st_blocks // 2


def in_fork(fn):
    """fn() in a fork of this process: (its wait status, its result, or the error it raised, as text)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            os.write(w, repr(fn()).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, ('%s: %s' % (type(e).__name__, e)).encode())
        finally:
            os._exit(code)
    os.close(w)
    out = b''
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return status, eval(out.decode()) if status == 0 else out.decode()  # noqa: S307 - our own fork's repr


class Toggler:
    """A thread that puts a marker into each page of a buffer made before the
    remap and takes it out again, checking each time: a write lost between a
    compare and a drop (or a copy and a remap) shows as a page that reads
    otherwise. Ends when stop is set; errors lists what it saw."""

    def __init__(self, buf, seed):
        self.buf, self.seed, self.errors, self.rounds = buf, seed, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        buf, pages = self.buf, len(self.buf) // PAGE
        while not self.stop.is_set():
            for i in range(pages):
                at = i * PAGE
                old = buf[at]
                mark = (old + 1 + self.seed) % 256
                buf[at] = mark
                if buf[at] != mark:
                    self.errors.append('page %d: marker lost' % i)
                buf[at] = old
                if buf[at] != old:
                    self.errors.append('page %d: restore lost' % i)
            self.rounds += 1


@contextlib.contextmanager
def toggling(bufs, seed):
    """A Toggler per buffer, running while the block runs; stopped and joined after it."""
    togglers = [Toggler(b, seed + i) for i, b in enumerate(bufs)]
    for t in togglers:
        t.thread.start()
    try:
        yield togglers
    finally:
        for t in togglers:
            t.stop.set()
            t.thread.join()


# Run as its own process: its main thread ends with pthread_exit (ctypes lets go of the GIL
# first), and the other thread remaps, copies a page, reclaims and prints what it saw.
ZOMBIE_MAIN = '''
import ctypes, mmap, os, threading, time
lib = ctypes.CDLL(%(so)r)
lib.fr_remap.restype = lib.fr_reclaim.restype = lib.fr_state_size.restype = ctypes.c_long
state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
scratch = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
st = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(state)))
buf = bytearray(b'\\x05' * (16 * 4096))
def worker():
    for _ in range(2000):
        with open('/proc/self/task/%%d/stat' %% os.getpid()) as f:
            main = f.read().rsplit(')', 1)[1].split()[0]
        if main == 'Z':
            break
        time.sleep(0.005)
    n = lib.fr_remap(st, ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))), ctypes.c_long(len(scratch)), ctypes.c_long(500))
    buf[4096] = 6
    buf[4096] = 5
    m = lib.fr_reclaim(st, ctypes.c_long(500))
    os.write(1, ('%%s %%d %%d' %% (main, n, m)).encode())
    os._exit(0 if buf == b'\\x05' * len(buf) else 3)
threading.Thread(target=worker).start()
ctypes.CDLL(None).pthread_exit(None)
'''


# Run as its own process: a thread that cannot park for 0.5 s (past a first try's wait, not a
# second's), as a thread of a loaded host may not; remap() tries again rather than leave the
# template without its file.
LATE_MAIN = '''
import os, signal, sys, threading, time
sys.path.insert(0, %(agent)r)
os.environ['FORKLING_PROCESS_RECLAIM'] = '1'
import forkling_memfile
gate, blocking = threading.Event(), threading.Event()
def late():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMAX})
    blocking.set()
    time.sleep(0.5)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGRTMAX})
    gate.wait()
t = threading.Thread(target=late)
t.start()
blocking.wait()
said = []
t0 = time.monotonic()
forkling_memfile.remap(said.append)
took = time.monotonic() - t0
gate.set()
t.join()
print(repr({'enabled': forkling_memfile.enabled(), 'said': said, 'took': took}))
'''


# Run as its own process (a remap changes it for good): fr_reclaim_wait sleeps after a reclaim
# until an fd is readable, and not at all after a reclaim that failed.
WAIT_MAIN = '''
import ctypes, mmap, os, select, threading, time
lib = ctypes.CDLL(%(so)r)
for fn in (lib.fr_remap, lib.fr_reclaim_wait, lib.fr_state_size, lib.fr_fd):
    fn.restype = ctypes.c_long
lib.fr_reclaim_wait.argtypes = (ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)
state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
scratch = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
st = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(state)))
buf = bytearray(b'\\x05' * (16 * 4096))
n = lib.fr_remap(st, ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))), ctypes.c_long(len(scratch)), ctypes.c_long(500))
assert n > 0, n
idle_r, idle_w = os.pipe()  # never written
r, w = os.pipe()
fds = (ctypes.c_int * 4)(idle_r, 1, r, 1)  # struct pollfd[2], POLLIN
buf[4096] = 6
buf[4096] = 5  # a copy of the file's bytes: given back
threading.Timer(0.4, os.write, (w, b'x')).start()
t = time.monotonic()
given = lib.fr_reclaim_wait(st, 500, fds, 2, 0)
slept = time.monotonic() - t
still = select.select([r], [], [], 0)[0] == [r]  # (what woke it is the caller's to read)
os.dup2(os.open('/dev/null', os.O_RDONLY), lib.fr_fd(st, 0))  # not the template's file any more: the reclaim fails
t = time.monotonic()
failed = lib.fr_reclaim_wait(st, 500, fds, 1, 0)
print(repr({'given': given, 'slept': slept, 'still': still, 'failed': failed, 'failed_in': time.monotonic() - t, 'buf': buf == b'\\x05' * len(buf)}))
'''

@unittest.skipUnless(os.path.exists(SO) and os.uname().machine == 'x86_64', 'forkling_reclaim.so not built (npm run build:native)')
class ReclaimTest(unittest.TestCase):
    def test_remap_and_reclaim_lose_nothing(self):
        # In a new interpreter: the remap changes the whole process for good, and malloc's heap is
        # fresh (a 1 MiB chunk is mmapped, not carved from a heap that earlier tests left large).
        done = subprocess.run([sys.executable, os.path.abspath(__file__), '--child'], capture_output=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        report = eval(done.stdout.decode())  # noqa: S307 - our own child's repr
        self.assertGreater(report['file_kib'], 1024, report)
        self.assertGreater(report['given_back'], 0, report)
        self.assertEqual(report['errors'], [], report)
        self.assertGreater(report['rounds'], 0, report)
        self.assertLess(report['private_after'], report['private_before'], report)
        self.assertEqual(report['sealed'], [{'write': 'EPERM', 'grow': 'EPERM', 'shrink': 'EPERM', 'map_shared_writable': 'EPERM'}] * 2, report)
        self.assertEqual(report['swapped_fd'], [-errno.EBADF] * 2, report)
        self.assertEqual(report['grown'], (True, b'\x0f'), report)
        kinds = report['kinds']
        memfd = '/memfd:forkling-template'
        self.assertEqual([kinds[k][1] for k in ('region', 'sparse')], [memfd, memfd], report)
        self.assertEqual(kinds['sparse_untouched'][1], '', report)  # (still anonymous)
        self.assertEqual(kinds['chunk'][1], '', report)
        self.assertEqual(kinds['rwx'], ('rwxp', ''), report)
        self.assertNotEqual(kinds['short'][1], '', report)
        self.assertFalse(kinds['short_past_end'][1].startswith(memfd), report)
        self.assertEqual(report['untouched_grew_kib'], 0, report)
        self.assertEqual((report['unsignalled'], report['blocked'], report['taken']), (-errno.EAGAIN, -errno.ETIMEDOUT, -errno.EEXIST), report)
        self.assertTrue(report['mapped_anew_kept'], report)
        self.assertEqual((report['short'], report['rwx']), (b'\x0d', b'\xc3'), report)
        # a second remap (as a fork server's): what was written since is a second file's, a
        # layer over the first; a fork's copies of it go back to those bytes
        self.assertEqual(report['files'], 2, report)
        self.assertTrue(kinds['layered'][1].startswith(memfd), report)
        self.assertNotEqual(report['layered_ino'], report['region_ino'], report)
        self.assertEqual(report['layered'], (True, True), report)

    def test_reclaim_wait_sleeps_after_a_reclaim_only(self):
        done = subprocess.run([sys.executable, '-c', WAIT_MAIN % {'so': SO}], capture_output=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        r = eval(done.stdout.decode())  # noqa: S307 - our own child's repr
        self.assertGreater(r['given'], 0, r)
        self.assertGreaterEqual(r['slept'], 0.35, r)
        self.assertTrue(r['still'] and r['buf'], r)
        self.assertEqual(r['failed'], -errno.EBADF, r)
        self.assertLess(r['failed_in'], 0.3, r)

    def test_remap_tries_again_when_a_thread_parks_late(self):
        done = subprocess.run([sys.executable, '-c', LATE_MAIN % {'agent': os.path.dirname(HERE)}], capture_output=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        r = eval(done.stdout.decode())  # noqa: S307 - our own child's repr
        self.assertEqual((r['enabled'], r['said']), (True, []), r)
        self.assertGreaterEqual(r['took'], 0.2, r)  # (the first try gave up: the second made it)

    def test_a_main_thread_that_exited_does_not_stop_it(self):
        # The main thread calls pthread_exit (it stays listed, a zombie, while another thread
        # runs): it runs no code again, so a remap and a reclaim go on without parking it.
        done = subprocess.run([sys.executable, '-c', ZOMBIE_MAIN % {'so': SO}], capture_output=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        state, remapped, given = done.stdout.decode().split()
        self.assertEqual(state, 'Z')
        self.assertGreater(int(remapped), 0)
        self.assertGreaterEqual(int(given), 0)

    def _child(self):
        lib = ctypes.CDLL(SO)
        self.region_at = apart(16, 0x09)
        # a large malloc chunk (glibc mmaps it): left as it is, as realloc grows it with mremap
        LIBC.malloc.restype = LIBC.realloc.restype = ctypes.c_void_p
        LIBC.malloc.argtypes = [ctypes.c_size_t]
        LIBC.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.chunk = LIBC.malloc(1 << 20)
        ctypes.memset(self.chunk, 0x0a, 1 << 20)
        self.again_at = apart(16, 0x0b)  # unmapped and mapped anew by a fork
        self.layered_at = apart(16, 0x31)  # written again between a first and a second remap
        self.sparse_at = apart(64, None)  # one page written: the other 63 untouched
        # executable: left as it is (a copy would lose PROT_EXEC)
        self.rwx_at = LIBC.mmap(None, PAGE, 7, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        ctypes.memset(self.rwx_at, 0xc3, PAGE)
        # a file's private mapping running past the file's end: its page past the end never read
        fd = os.open(os.path.join(os.environ.get('TMPDIR', '/tmp'), 'reclaim-short-%d' % os.getpid()), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, PAGE)
        self.short_at = LIBC.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        os.unlink('/proc/self/fd/%d' % fd) if False else os.unlink(os.readlink('/proc/self/fd/%d' % fd))
        os.close(fd)
        ctypes.memset(self.short_at, 0x0d, PAGE)
        lib.fr_remap.restype = lib.fr_reclaim.restype = lib.fr_state_size.restype = lib.fr_files.restype = ctypes.c_long
        lib.fr_files.argtypes = (ctypes.c_void_p,)
        state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
        scratch = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
        st = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(state)))
        # Made before the remap: it is the file's; non-zero, so it is in the file.
        bufs = [bytearray(b'\x07' * (64 * PAGE)) for _ in range(3)]

        ballast = [str(i) * 50 for i in range(20000)]  # objects a fork touches and leaves as they were
        gc.disable()  # as a zygote's forks (gc.freeze): a collection rewrites every object's header
        with toggling(bufs, 0) as togglers:
            written = lib.fr_remap(st, ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))),
                                   ctypes.c_long(len(scratch)), ctypes.c_long(2000))
        if written < 0:
            raise OSError(-written, 'fr_remap: ' + os.strerror(-written))
        ctypes.memset(self.layered_at, 0x32, 16 * PAGE)
        again = lib.fr_remap(st, ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))),
                             ctypes.c_long(len(scratch)), ctypes.c_long(2000))
        if again < 0:
            raise OSError(-again, 'fr_remap, the second: ' + os.strerror(-again))
        errors = [e for t in togglers for e in t.errors]
        self.kinds = {'region': mapping_of(self.region_at), 'sparse': mapping_of(self.sparse_at), 'chunk': mapping_of(self.chunk),
                      'sparse_untouched': mapping_of(self.sparse_at + PAGE), 'rwx': mapping_of(self.rwx_at),
                      'short': mapping_of(self.short_at), 'short_past_end': mapping_of(self.short_at + PAGE),
                      'layered': mapping_of(self.layered_at)}
        inode = {k: int(maps_entry(at)[4]) for k, at in (('region', self.region_at), ('layered', self.layered_at))}
        # a fork of the remapped process (as the fork server's children): its copies given back
        status, report = in_fork(lambda: self._grandchild(lib, st, bufs, ballast))
        if status != 0:
            raise RuntimeError('the fork ended with status %d: %s' % (status, report))
        report['errors'] = errors + report['errors']
        report['file_kib'] = written // 1024
        report['kinds'] = self.kinds
        report['files'] = lib.fr_files(st)
        report['region_ino'], report['layered_ino'] = inode['region'], inode['layered']
        return report

    def _grandchild(self, lib, st, bufs, ballast):
        # Touch and restore (as a fork's reference counts do), then give back while threads toggle.
        for b in bufs:
            for i in range(0, len(b), PAGE):
                v = b[i]
                b[i] = (v + 1) % 256
                b[i] = v
        for s in ballast:
            s.upper()
        for i in range(16):  # (the second file's bytes: copied, then the same again)
            ctypes.memset(self.layered_at + i * PAGE, 0x32, 1)
        copied = not any(file_page(self.layered_at + i * PAGE) for i in range(16))
        before = private_kib()
        given = lib.fr_reclaim(st, ctypes.c_long(2000))
        after = private_kib()
        layered = (copied and all(file_page(self.layered_at + i * PAGE) for i in range(16)),
                   ctypes.string_at(self.layered_at, 16 * PAGE) == b'\x32' * (16 * PAGE))
        # while threads write: every write kept
        with toggling(bufs, 10) as togglers:
            for _ in range(30):
                n = lib.fr_reclaim(st, ctypes.c_long(2000))
                if n < 0:
                    raise OSError(-n, 'fr_reclaim: ' + os.strerror(-n))
        errors = [e for t in togglers for e in t.errors]
        for b in bufs:  # the memory reads as it should
            if b != b'\x07' * len(b):
                errors.append('a buffer changed')
        if ballast[12345] != '12345' * 50:
            errors.append('an object changed')
        grown = self._grown()
        sealed, fds = self._sealed()
        # untouched memory stays anonymous: touching it now adds nothing to a file
        blocks = sum(file_kib(fd) for fd in fds)
        ctypes.memset(self.sparse_at, 0x0e, 64 * PAGE)
        untouched_grew = sum(file_kib(fd) for fd in fds) - blocks
        # memory unmapped and mapped anew (as heaps and arenas are) with the file's bytes: not the file's
        # any more, so never dropped (it would read zeros)
        LIBC.munmap(self.again_at, 16 * PAGE)
        LIBC.mmap(self.again_at, 16 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
        ctypes.memset(self.again_at, 0x0b, 16 * PAGE)
        lib.fr_reclaim(st, ctypes.c_long(2000))
        again = ctypes.string_at(self.again_at, 16 * PAGE) == b'\x0b' * (16 * PAGE)
        # sandbox code that puts another file at either fd's number: refused, nothing compared with it
        other = os.open('/dev/zero', os.O_RDONLY)
        swapped = []
        for fd in fds:
            saved = os.dup(fd)
            os.dup2(other, fd)
            swapped.append(lib.fr_reclaim(st, ctypes.c_long(2000)))
            os.dup2(saved, fd)  # (the file back at its number: else EBADF hides what is checked next)
            os.close(saved)
        # a thread that cannot be signalled (no room for a pending signal: EAGAIN): nothing done
        gate = threading.Event()
        t = threading.Thread(target=gate.wait)
        t.start()
        soft, hard = resource.getrlimit(resource.RLIMIT_SIGPENDING)
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, hard))
        try:
            unsignalled = lib.fr_reclaim(st, ctypes.c_long(100))
        finally:
            resource.setrlimit(resource.RLIMIT_SIGPENDING, (soft, hard))
        gate.set()
        t.join()
        # a thread that blocks the signal: nothing parked, nothing done; sandbox code's own handler for it: left
        gate = threading.Event()
        def blocker():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMAX})
            gate.wait()
        t = threading.Thread(target=blocker)
        t.start()
        blocked = lib.fr_reclaim(st, ctypes.c_long(100))
        gate.set()
        t.join()
        signal.signal(signal.SIGRTMAX, lambda *_: None)
        taken = lib.fr_reclaim(st, ctypes.c_long(100))
        return {'given_back': given, 'private_before': before, 'private_after': after, 'errors': errors,
                'rounds': min(t.rounds for t in togglers), 'sealed': sealed, 'swapped_fd': swapped, 'grown': grown,
                'untouched_grew_kib': untouched_grew, 'layered': layered, 'unsignalled': unsignalled, 'blocked': blocked, 'taken': taken, 'mapped_anew_kept': again,
                'short': ctypes.string_at(self.short_at, 1), 'rwx': ctypes.string_at(self.rwx_at, 1)}

    def _grown(self):
        """A large malloc chunk of the parent, grown by realloc (mremap): its bytes kept, the rest
        writable (made the file's, it would have grown into the file's next bytes, and past its end
        faulted)."""
        new = LIBC.realloc(self.chunk, 256 << 20)
        if not new:
            return 'realloc failed'
        ctypes.memset(new + (255 << 20), 0x0f, 1 << 20)
        return (ctypes.string_at(new, 1 << 20) == b'\x0a' * (1 << 20), ctypes.string_at(new + (256 << 20) - 1, 1))

    @staticmethod
    def _sealed():
        """What sandbox code gets trying to change each file through the fds every fork holds:
        one dict per file (and their fds)."""
        def name(n):
            try:
                return os.readlink('/proc/self/fd/%s' % n)
            except OSError:
                return ''  # (listdir's own fd)
        fds = sorted(int(n) for n in os.listdir('/proc/self/fd') if 'forkling-template' in name(n))
        out = []
        for fd in fds:
            got = {}
            for what, fn in (('write', lambda: os.pwrite(fd, b'x', 0)), ('grow', lambda: os.ftruncate(fd, 1 << 30)),
                             ('shrink', lambda: os.ftruncate(fd, 0)),
                             ('map_shared_writable', lambda: mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_WRITE))):
                try:
                    fn()
                    got[what] = 'done'
                except OSError as e:
                    got[what] = errno.errorcode[e.errno]
            out.append(got)
        return out, fds

if __name__ == '__main__':
    if sys.argv[1:] == ['--child']:
        print(repr(ReclaimTest()._child()))
    else:
        unittest.main()
