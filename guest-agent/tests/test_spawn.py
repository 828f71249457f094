"""forkling_spawn.c, the fork server's fork loop and child set-up in C,
driven with forkling_zygote's own structures and plan steps: each child is
PID 1 of a new pid namespace, runs the steps (its own host name, lo up, a
kept fd), holds only its own ready pipe, and a failing step is reported with
its index and errno. And its server loop (fs_serve), spoken to with
forkling_zygote's messages: children ready, failed (with what they said),
timed out (killed) or not forked; a failed call; an adoption it cannot do;
a message it does not know; the zygote's end closed. Needs root (new pid,
uts and network namespaces) and the built library (npm run build:native)."""

import ctypes
import errno
import fcntl
import json
import os
import socket
import stat
import struct
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import forkling_zygote as z  # noqa: E402

SO = os.path.join(os.path.dirname(HERE), 'forkling_spawn.so')


class _Log:
    @staticmethod
    def log(msg):
        raise AssertionError(msg)


def _pipes(skip=()):
    """{(device, inode)} of the pipes among this process's fds, but those in skip."""
    out = set()
    for fd in map(int, os.listdir('/proc/self/fd')):
        try:
            st = os.fstat(fd)
        except OSError:
            continue  # (the listing's own fd)
        if stat.S_ISFIFO(st.st_mode) and fd not in skip:
            out.add((st.st_dev, st.st_ino))
    return out


def _report(kids, i, extra, had):
    """In child i: what it sees, as JSON on its ready pipe; then it exits."""
    k = kids[i]
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flags = struct.unpack('16sH22x', fcntl.ioctl(s.fileno(), 0x8913, struct.pack('16s24x', b'lo')))[1]
        s.close()
        pipes = len(_pipes({k.ready_w}) - had)  # new since the spawn, but its own ready pipe
        msg = {'i': i, 'pid': os.getpid(), 'host': socket.gethostname(), 'lo_up': bool(flags & 1),
               'failed': k.step_failed, 'err': k.err, 'keep_fd': k.keep_fd, 'other_pipes': pipes}
        if k.keep_fd >= 0:
            msg['kept_is_dir'] = os.path.samestat(os.fstat(k.keep_fd), os.stat(extra))
        os.write(k.ready_w, json.dumps(msg).encode())
    finally:
        os._exit(0)


@unittest.skipUnless(os.geteuid() == 0, 'needs root: new pid, uts and network namespaces')
class SpawnTest(unittest.TestCase):
    def setUp(self):
        z._agent_mod = _Log
        z._SPAWN.clear()
        self.assertTrue(os.path.exists(SO), '%s is not built: run npm run build:native' % SO)
        self.assertIsNotNone(z._spawn_lib())
        self.tmp = tempfile.mkdtemp()
        self.pidns = os.open('/proc/self/ns/pid', os.O_RDONLY | os.O_CLOEXEC)
        self.addCleanup(os.close, self.pidns)
        self.addCleanup(os.rmdir, self.tmp)

    def spawn(self, names, steps):
        plan = {'before_layer': steps, 'after_layer': [], 'pivot': []}
        arr, flat = z._c_steps(plan)
        kids = (z._Child * len(names))()
        encoded = [n.encode() for n in names]
        for k, n in zip(kids, encoded):
            k.hostname, k.hostname_len = n, len(n)
        had = _pipes()
        i = z._SPAWN['lib'](ctypes.byref(z._SPAWN['libc']), self.pidns, kids, len(names), arr, len(flat))
        if i >= 0:
            _report(kids, i, self.tmp, had)  # never returns
        out = []
        for k in kids:
            self.assertGreater(k.pid, 0)
            data = b''
            while True:
                chunk = os.read(k.ready_r, 4096)
                if not chunk:
                    break
                data += chunk
            os.close(k.ready_r)
            os.waitpid(k.pid, 0)
            out.append(json.loads(data))
        return kids, out

    def test_children_set_up_in_c(self):
        steps = [
            z._step('unshare', z.CLONE_NEWUTS | z.CLONE_NEWNET),
            z._step('sethostname', kind=z.STEP_HOSTNAME, what='sethostname'),
            (z.STEP_LO_UP, None, (), 'lo up'),
            z._step('open', self.tmp.encode(), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, kind=z.STEP_KEEP_FD),
        ]
        kids, out = self.spawn(['alpha', 'beta', 'gamma'], steps)
        self.assertEqual(len({k.pid for k in kids}), 3)
        self.assertEqual([o['i'] for o in out], [0, 1, 2])
        for name, o in zip(['alpha', 'beta', 'gamma'], out):
            self.assertEqual(o['pid'], 1, 'PID 1 of a new pid namespace')
            self.assertEqual(o['host'], name)
            self.assertTrue(o['lo_up'])
            self.assertEqual(o['failed'], -1)
            self.assertTrue(o['kept_is_dir'])
            self.assertEqual(o['other_pipes'], 0, 'a child holds pipes of its siblings or its parent')
        self.assertNotIn(socket.gethostname(), ['alpha', 'beta', 'gamma'])
        self.assertNotEqual(os.getpid(), 1)  # the caller's pid namespace is back

    def test_a_failed_call_in_the_parent_stops_the_loop(self):
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = set(map(int, os.listdir('/proc/self/fd')))
        lowest_free = min(set(range(len(used) + 1)) - used)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # pipe2 has no fd left
        try:
            plan = {'before_layer': [], 'after_layer': [], 'pivot': []}
            arr, flat = z._c_steps(plan)
            kids = (z._Child * 2)()
            i = z._SPAWN['lib'](ctypes.byref(z._SPAWN['libc']), self.pidns, kids, 2, arr, len(flat))
            if i >= 0:
                os._exit(1)  # (forked after all: the parent's checks below fail)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        self.assertEqual(i, -1)
        self.assertEqual((kids[0].pid, kids[0].failed_call, kids[0].err), (0, 1, errno.EMFILE))  # (1: CALL_PIPE2)
        self.assertEqual((kids[1].pid, kids[1].failed_call), (0, 0), 'the rest are not forked')

    def test_failed_step_is_reported(self):
        steps = [
            z._step('unshare', z.CLONE_NEWUTS),
            z._step('mkdir', self.tmp.encode(), 0o755),  # exists: EEXIST
            z._step('sethostname', kind=z.STEP_HOSTNAME, what='sethostname'),
        ]
        _, out = self.spawn(['one', 'two'], steps)
        for o in out:
            self.assertEqual((o['failed'], o['err']), (1, errno.EEXIST))
            self.assertNotIn(o['host'], ('one', 'two'), 'steps after the failed one ran')
        e = z._step_error(steps[1], errno.EEXIST)
        self.assertIn('mkdir %s' % self.tmp, str(e))


def _serve_child(serve):
    """In a child fs_serve forked (it returned its index): as its id says, say ok (if what it was
    told is what it is), fail with a text, or hang."""
    try:
        name, host = serve.id.decode(), serve.hostname.decode()
        if name.startswith('slow'):
            import time
            time.sleep(30)
        seen = '%s %s %d pid %d' % (name, socket.gethostname() == host, serve.flags, os.getpid())
        ok = name.startswith('ok') and seen == '%s True 0 pid 1' % name
        os.write(serve.ready_w, b'ok' if ok else seen.encode())
    finally:
        os._exit(0)


@unittest.skipUnless(os.geteuid() == 0 and os.uname().machine == 'x86_64', 'needs root and x86-64')
class ServeTest(unittest.TestCase):
    def setUp(self):
        z._agent_mod = _Log
        z._SPAWN.clear()
        self.assertIsNotNone(z._spawn_lib())
        self.pidns = os.open('/proc/self/ns/pid', os.O_RDONLY | os.O_CLOEXEC)
        self.addCleanup(os.close, self.pidns)

    def server(self, ready_timeout_ms=10000, no_fds=False):
        """A fork server (a fork of this process) in fs_serve; returns (our end of its socket, its pid)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        steps = [z._step('unshare', z.CLONE_NEWUTS), z._step('sethostname', kind=z.STEP_HOSTNAME, what='sethostname')]
        arr, flat = z._c_steps({'before_layer': steps, 'after_layer': [], 'pivot': []})
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                a.close()
                if no_fds:  # (no fd free below the limit: pipe2 fails)
                    import resource
                    used = set(map(int, os.listdir('/proc/self/fd')))
                    lowest_free = min(set(range(len(used) + 1)) - used)
                    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
                serve = z._Serve(sock=b.fileno(), pidns_fd=self.pidns, steps=ctypes.addressof(arr), nsteps=len(flat),
                                 ready_timeout_ms=ready_timeout_ms, reap_ms=50)
                i = z._SPAWN['serve'](ctypes.byref(z._SPAWN['libc']), ctypes.byref(serve))
                if i >= 0:
                    _serve_child(serve)
                code = -i
            finally:
                os._exit(code)
        b.close()
        self.addCleanup(a.close)
        return a, pid

    @staticmethod
    def ask(sock, children):
        z._send_msg(sock, z._pack_fork(children))
        return z._unpack_answer(z._recv_msg(sock), children)

    def test_serves_until_the_zygote_closes(self):
        sock, pid = self.server()
        kids = [{'id': 'ok-a', 'hostname': 'alpha'}, {'id': 'fail-b', 'hostname': 'beta', 'pattern': True},
                {'id': 'ok-c', 'hostname': 'gamma'}]
        got = self.ask(sock, kids)
        self.assertEqual([r['ok'] for r in got], [True, False, True], got)
        self.assertEqual(got[1]['error'], 'fail-b True 1 pid 1', 'what the child said, and what it was told')
        for r in (got[0], got[2]):
            self.assertGreater(r['pid'], 0)
            self.assertGreater(r['setupMs'], 0)
        again = self.ask(sock, [{'id': 'ok-d', 'hostname': 'delta'}])  # (the loop goes on)
        self.assertTrue(again[0]['ok'], again)
        z._send_msg(sock, z._pack_adopt(1, 3, b'', b''))  # (no fr_adopt given: refused)
        self.assertEqual(struct.unpack('=qq', z._recv_msg(sock)), (-errno.ENOSYS, 0))
        sock.shutdown(socket.SHUT_WR)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), errno.EPIPE, 'the zygote closed its end')

    def test_a_child_not_ready_in_time_is_killed(self):
        sock, pid = self.server(ready_timeout_ms=300)
        got = self.ask(sock, [{'id': 'slow-a', 'hostname': 'alpha'}, {'id': 'ok-b', 'hostname': 'beta'}])
        self.assertIn('not ready within', got[0]['error'])
        self.assertTrue(got[1]['ok'], got)
        sock.close()
        os.waitpid(pid, 0)

    def test_a_failed_call_fails_the_rest(self):
        sock, pid = self.server(no_fds=True)
        got = self.ask(sock, [{'id': 'ok-a', 'hostname': 'alpha'}, {'id': 'ok-b', 'hostname': 'beta'}])
        self.assertEqual(got[0], {'id': 'ok-a', 'ok': False, 'error': 'fork: pipe2: %s' % os.strerror(errno.EMFILE)})
        self.assertEqual(got[1]['error'], 'not forked: ' + got[0]['error'])
        sock.close()
        os.waitpid(pid, 0)

    def test_a_message_it_does_not_know_ends_it(self):
        sock, pid = self.server()
        z._send_msg(sock, struct.pack('=I', 9))
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), errno.EPROTO)


if __name__ == '__main__':
    unittest.main()
