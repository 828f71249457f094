"""forkling_reclaim.c: a process's private memory made a sealed file's
(fr_remap) while other threads write, and forks that give back their pages
equal to that file (fr_reclaim) while their threads write: no write is lost,
the memory reads the same, pages come back, and no sandbox can change the
file. Needs the built library (npm run build:native); x86-64."""

import ctypes
import errno
import gc
import mmap
import os
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


@unittest.skipUnless(os.path.exists(SO) and os.uname().machine == 'x86_64', 'forkling_reclaim.so not built (npm run build:native)')
class ReclaimTest(unittest.TestCase):
    def test_remap_and_reclaim_lose_nothing(self):
        # In a fork of the test process: the remap changes the whole process for good.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 1
            try:
                report = self._child()
                os.write(w, repr(report).encode())
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(w, ('error %s: %s' % (type(e).__name__, e)).encode())
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
        self.assertEqual(status, 0, out.decode())
        report = eval(out.decode())  # noqa: S307 - our own child's repr
        self.assertGreater(report['file_kib'], 1024, report)
        self.assertGreater(report['given_back'], 0, report)
        self.assertEqual(report['errors'], [], report)
        self.assertGreater(report['rounds'], 0, report)
        self.assertLess(report['private_after'], report['private_before'], report)
        self.assertEqual(report['sealed'], {'write': 'EPERM', 'grow': 'EPERM', 'shrink': 'EPERM', 'map_shared_writable': 'EPERM'}, report)
        self.assertEqual(report['swapped_fd'], -errno.EBADF, report)

    def _child(self):
        lib = ctypes.CDLL(SO)
        lib.fr_remap.restype = lib.fr_reclaim.restype = lib.fr_state_size.restype = ctypes.c_long
        state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
        scratch = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
        st = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(state)))
        # Made before the remap: it is the file's; non-zero, so it is in the file.
        bufs = [bytearray(b'\x07' * (64 * PAGE)) for _ in range(3)]
        ballast = [str(i) * 50 for i in range(20000)]  # objects a fork touches and leaves as they were
        togglers = [Toggler(b, i) for i, b in enumerate(bufs)]
        for t in togglers:
            t.thread.start()
        gc.disable()  # as a zygote's forks (gc.freeze): a collection rewrites every object's header
        written = lib.fr_remap(st, ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))),
                               ctypes.c_long(len(scratch)), ctypes.c_long(2000))
        if written < 0:
            raise OSError(-written, 'fr_remap: ' + os.strerror(-written))
        for t in togglers:
            t.stop.set()
            t.thread.join()
        errors = [e for t in togglers for e in t.errors]
        # a fork of the remapped process (as the fork server's children): its copies given back
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            out = self._grandchild(lib, st, bufs, ballast)
            os.write(w, repr(out).encode())
            os._exit(0)
        os.close(w)
        data = b''
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        os.waitpid(pid, 0)
        report = eval(data.decode())  # noqa: S307
        report['errors'] = errors + report['errors']
        report['file_kib'] = written // 1024
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
        before = private_kib()
        given = lib.fr_reclaim(st, ctypes.c_long(2000))
        after = private_kib()
        # while threads write: every write kept
        togglers = [Toggler(b, 10 + i) for i, b in enumerate(bufs)]
        for t in togglers:
            t.thread.start()
        for _ in range(30):
            n = lib.fr_reclaim(st, ctypes.c_long(2000))
            if n < 0:
                raise OSError(-n, 'fr_reclaim: ' + os.strerror(-n))
        for t in togglers:
            t.stop.set()
            t.thread.join()
        errors = [e for t in togglers for e in t.errors]
        for b in bufs:  # the memory reads as it should
            if b != b'\x07' * len(b):
                errors.append('a buffer changed')
        if ballast[12345] != '12345' * 50:
            errors.append('an object changed')
        sealed, fd = self._sealed()
        # sandbox code that puts another file at the fd's number: refused, nothing compared with it
        other = os.open('/dev/zero', os.O_RDONLY)
        os.dup2(other, fd)
        swapped = lib.fr_reclaim(st, ctypes.c_long(2000))
        return {'given_back': given, 'private_before': before, 'private_after': after, 'errors': errors,
                'rounds': min(t.rounds for t in togglers), 'sealed': sealed, 'swapped_fd': swapped}

    @staticmethod
    def _sealed():
        """What sandbox code gets trying to change the file through the fd every fork holds."""
        def name(n):
            try:
                return os.readlink('/proc/self/fd/%s' % n)
            except OSError:
                return ''  # (listdir's own fd)
        fd = next(int(n) for n in os.listdir('/proc/self/fd') if 'forkling-template' in name(n))
        out = {}
        for what, fn in (('write', lambda: os.pwrite(fd, b'x', 0)), ('grow', lambda: os.ftruncate(fd, 1 << 30)),
                         ('shrink', lambda: os.ftruncate(fd, 0)),
                         ('map_shared_writable', lambda: mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_WRITE))):
            try:
                fn()
                out[what] = 'done'
            except OSError as e:
                out[what] = errno.errorcode[e.errno]
        return out, fd

if __name__ == '__main__':
    unittest.main()
