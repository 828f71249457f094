"""forkling_reclaim.c's pattern: a process remaps its memory (fr_remap); a
fork of it (the pattern child) writes some pages and makes them a file of
its own (fr_remap again); the process takes that file (fr_adopt, which
refuses what is not sealed or whose runs are out of order or past its end);
a new fork copies ahead the pages the pattern child wrote (fr_prefault),
those it wrote back to the template's bytes too, its bytes unchanged (the
process that took the pattern unmapped those of them that were its files'
pages, so that forks start without them); a later fork that wrote the same bytes to the same pages gets the pattern's
pages mapped over its copies at reclaim (fr_reclaim), keeps the pages that
differ, loses no write made while it reclaims, and what it writes after is
its own; memory made executable since keeps its protection. Needs the built library (npm run build:native); x86-64."""

import ctypes
import errno
import mmap
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import forkling_memfile as memfile  # noqa: E402
import test_reclaim as tr  # noqa: E402

PAGE = tr.PAGE
RUN = 24  # sizeof(struct fr_region)
PREFAULT_MAX_PAGES = 1024  # forkling_reclaim.c's FR_PREFAULT_MAX_PAGES
# MADV_POPULATE_WRITE came with Linux 5.14: before, fr_adopt keeps no page to copy ahead
POPULATES = tuple(int(x) for x in re.match(r'(\d+)\.(\d+)', os.uname().release).groups()) >= (5, 14)


def load():
    """The library as the engine loads it (forkling_memfile: its functions' types set)."""
    said = []
    lib = memfile._load(said.append)
    if lib is None:
        raise AssertionError('forkling_reclaim.so did not load: %s' % said)
    return lib


def run(start, end, off):
    return (start).to_bytes(8, 'little') + (end).to_bytes(8, 'little') + (off).to_bytes(8, 'little')


def present(at):
    """Whether the page at `at` is in this process's page table (without reading it)."""
    with open('/proc/self/pagemap', 'rb') as f:
        f.seek(at // PAGE * 8)
        return bool(int.from_bytes(f.read(8), 'little') >> 63 & 1)


def inode(at):
    return int(tr.maps_entry(at)[4])


def refuse_mmaps_of(fd):
    """From now on, in this thread: an mmap of fd fails with ENOMEM, as one past the limit of
    mappings would (a seccomp filter: nr, then the low half of args[4])."""
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    prog = ((ld, 0, 0, 0), (jeq, 0, 3, 9), (ld, 0, 0, 16 + 4 * 8), (jeq, 0, 1, fd),
            (ret, 0, 0, 0x00050000 | errno.ENOMEM), (ret, 0, 0, 0x7fff0000))
    filt = b''.join(code.to_bytes(2, 'little') + bytes((jt, jf)) + k.to_bytes(4, 'little') for code, jt, jf, k in prog)
    buf = ctypes.create_string_buffer(filt, len(filt))
    fprog = len(prog).to_bytes(8, 'little') + ctypes.addressof(buf).to_bytes(8, 'little')  # (u16 len, padding, pointer)
    if tr.LIBC.prctl(38, 1, 0, 0, 0) != 0 or tr.LIBC.syscall(317, 1, 0, ctypes.c_char_p(fprog)) != 0:  # NO_NEW_PRIVS, seccomp
        raise OSError(ctypes.get_errno(), 'seccomp')


class Scenario:
    """Runs in a process of its own (the remaps change it for good)."""

    def __init__(self):
        self.lib = load()
        self.big = tr.apart(PREFAULT_MAX_PAGES + 100, 0x33)  # (mapped above the region: after it in address order)
        self.region = tr.apart(8, 0x21)  # (before the state and scratch: a mapping merged with them is left out)
        self.state = mmap.mmap(-1, self.lib.fr_state_size(), flags=mmap.MAP_PRIVATE)
        self.scratch = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE)
        self.st = ctypes.addressof(ctypes.c_char.from_buffer(self.state))
        self.bufs = [bytearray(b'\x07' * (16 * PAGE)) for _ in range(2)]  # toggled while forks reclaim

    def remap(self):
        n = self.lib.fr_remap(self.st, ctypes.addressof(ctypes.c_char.from_buffer(self.scratch)), len(self.scratch), 2000)
        if n < 0:
            raise OSError(-n, 'fr_remap: ' + os.strerror(-n))

    def page(self, i):
        return self.region + i * PAGE

    def fill(self, i, byte):
        ctypes.memset(self.page(i), byte, PAGE)

    def pattern_child(self):
        """Forks the pattern child: pages 0, 1, 3, 4 and 6 of the region and the buffers its own
        (page 5 written and written back), then its file. Returns (its pid, its fd of the file,
        the runs, the pages it wrote, a pipe end that lets it exit)."""
        r, w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(done_w)
                for i, byte in ((0, 0x41), (1, 0x42), (3, 0x43), (4, 0x44), (5, 0x55), (5, 0x21), (6, 0x46)):
                    self.fill(i, byte)
                for b in self.bufs:
                    b[:] = b'\x08' * len(b)
                ctypes.memset(self.big, 0x34, (PREFAULT_MAX_PAGES + 100) * PAGE)
                lib, st = self.lib, self.st
                n = lib.fr_reclaim_wait(st, 2000, None, 0, 1)  # (its publish, as in forkling_memfile.when_idle)
                if n < 0:
                    raise OSError(-n, 'publish: ' + os.strerror(-n))
                fd = lib.fr_fd(st, lib.fr_files(st) - 1)
                runs = ctypes.string_at(lib.fr_runs(st), lib.fr_nruns(st) * RUN)
                written = ctypes.string_at(lib.fr_written(st), lib.fr_nwritten(st) * RUN)
                os.write(w, repr((fd, runs, written)).encode())
                os.read(done_r, 1)
            finally:
                os._exit(0)
        os.close(w)
        os.close(done_r)
        fd, runs, written = eval(os.read(r, 1 << 20).decode())  # noqa: S307 - our own fork's repr
        os.close(r)
        return pid, fd, runs, written, done_w

    def refusals(self, fd, runs, written):
        """fr_adopt's checks, each refused with nothing changed."""
        lib, st = self.lib, self.st
        out = {}
        unsealed = os.memfd_create('unsealed', os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 16 * PAGE)
        out['unsealed'] = lib.fr_adopt(st, unsealed, run(self.region, self.region + PAGE, 0), 1, b'', 0, None)
        os.close(unsealed)
        size = os.fstat(fd).st_size
        first = int.from_bytes(runs[:8], 'little')
        out['past_end'] = lib.fr_adopt(st, fd, run(first, first + PAGE, size), 1, b'', 0, None)
        out['misaligned'] = lib.fr_adopt(st, fd, run(first + 1, first + PAGE + 1, 0), 1, b'', 0, None)
        out['out_of_order'] = lib.fr_adopt(st, fd, run(first + PAGE, first + 2 * PAGE, 0) + run(first, first + PAGE, 0), 2, b'', 0, None)
        out['none'] = lib.fr_adopt(st, fd, b'', 0, b'', 0, None)
        w1 = int.from_bytes(written[:8], 'little')
        out['written_out_of_order'] = lib.fr_adopt(st, fd, runs, len(runs) // RUN, run(w1 + PAGE, w1 + 2 * PAGE, 0) + run(w1, w1 + PAGE, 0), 2, None)
        out['written_misaligned'] = lib.fr_adopt(st, fd, runs, len(runs) // RUN, run(w1 + 8, w1 + PAGE, 0), 1, None)
        out['left_as_it_was'] = (lib.fr_pattern(st), lib.fr_files(st))
        return out

    def fork_that_writes(self, same):
        """In a fork: writes the pattern's bytes (or others where `same` says not) and the
        buffers, reclaims (while threads toggle the buffers), and reports what it sees."""
        lib, st = self.lib, self.st
        for i, byte in ((0, 0x41), (1, 0x42 if same else 0x99), (3, 0x43), (4, 0x44)):
            self.fill(i, byte)
        self.fill(2, 0x21)  # (the template's bytes again: given back to its file)
        if same:  # the pattern's bytes, in memory made executable since (a JIT's): left as it is
            self.fill(6, 0x46)
            if tr.LIBC.mprotect(self.page(6), PAGE, mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC) != 0:
                raise OSError(ctypes.get_errno(), 'mprotect')
        for b in self.bufs:
            b[:] = b'\x08' * len(b)
        before = tr.private_kib()
        n = lib.fr_reclaim(st, 2000)
        after = tr.private_kib()
        pattern_ino = os.fstat(lib.fr_fd(st, lib.fr_pattern(st))).st_ino
        seen = {
            'given': n, 'before': before, 'after': after,
            'pattern': [inode(self.page(i)) == pattern_ino for i in range(5)],
            'file_page': [tr.file_page(self.page(i)) for i in range(5)],
            'bytes': [ctypes.string_at(self.page(i), 1)[0] for i in range(5)],
            'exec': (tr.maps_entry(self.page(6))[1], inode(self.page(6)) == pattern_ino, ctypes.string_at(self.page(6), 1)[0]) if same else None,
            'whole': all(ctypes.string_at(self.page(i), PAGE) == bytes((b,)) * PAGE
                         for i, b in enumerate((0x41, 0x42 if same else 0x99, 0x21, 0x43, 0x44))),
        }
        with tr.toggling(self.bufs, 3) as togglers:
            for _ in range(30):
                k = lib.fr_reclaim(st, 2000)
                if k < 0:
                    raise OSError(-k, 'fr_reclaim: ' + os.strerror(-k))
        seen['errors'] = [e for t in togglers for e in t.errors]
        seen['rounds'] = min(t.rounds for t in togglers)
        seen['bufs_kept'] = all(b == b'\x08' * len(b) for b in self.bufs)
        seen['bufs_pattern'] = tr.maps_entry(ctypes.addressof(ctypes.c_char.from_buffer(self.bufs[0])) + 8 * PAGE)[4] == str(pattern_ino)
        self.fill(0, 0x77)  # its own from here on
        seen['written_after'] = ctypes.string_at(self.page(0), 1)[0]
        return seen

    def fork_refused(self):
        """In a fork: writes the pattern's bytes as fork_that_writes does, then reclaims with every
        mmap of the pattern refused: the pages it had given back already hold their bytes again."""
        lib, st = self.lib, self.st
        for i, byte in ((0, 0x41), (1, 0x42), (2, 0x21), (3, 0x43), (4, 0x44)):
            self.fill(i, byte)
        pattern_fd = lib.fr_fd(st, lib.fr_pattern(st))
        pattern_ino = os.fstat(pattern_fd).st_ino
        refuse_mmaps_of(pattern_fd)
        n = lib.fr_reclaim(st, 2000)
        return {
            'given': n,
            'pattern': [inode(self.page(i)) == pattern_ino for i in range(5)],
            'file_page': [tr.file_page(self.page(i)) for i in range(5)],
            'whole': all(ctypes.string_at(self.page(i), PAGE) == bytes((b,)) * PAGE for i, b in enumerate((0x41, 0x42, 0x21, 0x43, 0x44))),
        }

    def prefaulted(self):
        """In a fork: fr_prefault copies the pages the pattern child wrote (0, 1, 3, 4, 5, 6 of the
        region, the buffers), the bytes the template's, and no other."""
        lib, st = self.lib, self.st
        before = [tr.file_page(self.page(i)) for i in range(7)]
        n = lib.fr_prefault(st)
        return {'n': n, 'before': before, 'after': [tr.file_page(self.page(i)) for i in range(7)],
                'bytes': all(ctypes.string_at(self.page(i), PAGE) == b'\x21' * PAGE for i in range(7)),
                'bufs': all(b == b'\x07' * len(b) for b in self.bufs)}

    def main(self):
        self.remap()  # the template's file (as the zygote's)
        lib, st = self.lib, self.st
        pid, fd, runs, written, done = self.pattern_child()
        mine = os.open('/proc/%d/fd/%d' % (pid, fd), os.O_RDONLY | os.O_CLOEXEC)
        report = {'refused': self.refusals(mine, runs, written)}
        ahead = ctypes.c_long(-1)
        report['adopted'] = lib.fr_adopt(st, mine, runs, len(runs) // RUN, written, len(written) // RUN, ctypes.byref(ahead))
        report['ahead'] = ahead.value
        report['adopter_mapped'] = [present(self.page(i)) for i in range(7)]
        report['again'] = lib.fr_adopt(st, mine, runs, len(runs) // RUN, written, len(written) // RUN, None)
        report['pattern_index'], report['files'] = lib.fr_pattern(st), lib.fr_files(st)
        report['file_size'] = os.fstat(mine).st_size
        os.close(done)
        os.waitpid(pid, 0)  # (the pattern child gone: its file lives on with our fd)
        report['prefault'] = tr.in_fork(self.prefaulted)
        status, report['fork'] = tr.in_fork(lambda: self.fork_that_writes(True))
        status2, report['sibling'] = tr.in_fork(lambda: self.fork_that_writes(False))
        report['mmap_refused'] = tr.in_fork(self.fork_refused)
        report['status'] = (status, status2)
        report['here'] = [ctypes.string_at(self.page(i), 1)[0] for i in range(5)]
        return report


@unittest.skipUnless(os.path.exists(tr.SO) and os.uname().machine == 'x86_64', 'forkling_reclaim.so not built (npm run build:native)')
class PatternTest(unittest.TestCase):
    def test_pattern(self):
        done = subprocess.run([sys.executable, os.path.abspath(__file__), '--child'], capture_output=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr.decode()[-3000:])
        r = eval(done.stdout.decode())  # noqa: S307 - our own child's repr
        self.assertEqual(r['refused'], {'unsealed': -errno.EPERM, 'past_end': -errno.EINVAL, 'misaligned': -errno.EINVAL,
                                        'out_of_order': -errno.EINVAL, 'none': -errno.EINVAL, 'written_out_of_order': -errno.EINVAL,
                                        'written_misaligned': -errno.EINVAL, 'left_as_it_was': (-1, 1)}, r)
        self.assertEqual(r['adopted'], r['file_size'], r)
        self.assertGreater(r['file_size'], 0, r)
        self.assertEqual((r['again'], r['pattern_index'], r['files']), (-errno.EEXIST, 1, 2), r)
        self.assertEqual(r['status'], (0, 0), r)
        status, p = r['prefault']
        self.assertEqual(status, 0, p)
        self.assertEqual(p['before'], [True] * 7, r)
        if POPULATES:
            self.assertEqual(p['after'], [False, False, True, False, False, False, False], 'the pages the pattern child wrote copied, no other')
            self.assertEqual(p['n'], PREFAULT_MAX_PAGES, 'no more than FR_PREFAULT_MAX_PAGES (the pattern child wrote more)')
        else:
            self.assertEqual((p['after'], p['n']), (p['before'], 0), 'nothing copied ahead without MADV_POPULATE_WRITE')
        self.assertEqual(p['n'], r['ahead'], 'adopt says how many pages a fork copies ahead')
        if POPULATES:  # (its file's pages, which forks copy ahead: not mapped in the forks either; page 2 stays)
            self.assertEqual(r['adopter_mapped'], [False, False, True, False, False, False, False], r)
        self.assertEqual((p['bytes'], p['bufs']), (True, True), 'no byte changed')
        f = r['fork']
        # pages 0, 1, 3, 4: the pattern's now; page 2: its template file's again; all read as written
        self.assertEqual(f['pattern'], [True, True, False, True, True], r)
        self.assertEqual(f['file_page'], [True] * 5, r)
        self.assertTrue(f['whole'], r)
        self.assertGreaterEqual(f['given'], 5, r)
        self.assertLessEqual(f['after'], f['before'] - 5 * 4, r)
        self.assertEqual((f['errors'], f['bufs_kept'], f['bufs_pattern']), ([], True, True), r)
        self.assertGreater(f['rounds'], 0, r)
        self.assertEqual(f['written_after'], 0x77, r)
        self.assertEqual(f['exec'], ('rwxp', False, 0x46), 'an executable mapping keeps its protection')
        # a sibling that wrote other bytes to page 1 keeps its own copy there; the first fork's
        # write after its reclaim is not in the pattern
        s = r['sibling']
        self.assertEqual(s['pattern'], [True, False, False, True, True], r)
        self.assertEqual(s['file_page'], [True, False, True, True, True], r)
        self.assertEqual(s['bytes'], [0x41, 0x99, 0x21, 0x43, 0x44], r)
        self.assertTrue(s['whole'], r)
        self.assertEqual(r['here'], [0x21] * 5, 'the process that took the pattern kept its own bytes')
        # every mmap of the pattern refused (as at the limit of mappings), after its pages were
        # given back (one process_madvise for the whole reclaim): each holds its bytes again, its
        # own copy; page 2, the template's bytes, is given back all the same
        status, x = r['mmap_refused']
        self.assertEqual(status, 0, x)
        self.assertEqual((x['pattern'], x['file_page'], x['whole']), ([False] * 5, [False, False, True, False, False], True), r)
        self.assertGreaterEqual(x['given'], 1, r)


if __name__ == '__main__':
    if sys.argv[1:] == ['--child']:
        print(repr(Scenario().main()))
    else:
        unittest.main()
