"""PID-1 helpers that can run off PID 1: the module list, finit_module calls
(through a fake syscall), zombie detection for the reaper."""

import os
import tempfile
import time
import unittest

from test_protocol import agent


class Modules(unittest.TestCase):
    def test_parse(self):
        text = '# comment\n\nlib/modules/6.1/kernel/a.ko\n/lib/modules/6.1/b.ko.xz  opt=1 x=y \n'
        self.assertEqual(agent.parse_module_list(text), [
            ('/lib/modules/6.1/kernel/a.ko', ''),
            ('/lib/modules/6.1/b.ko.xz', 'opt=1 x=y'),
        ])

    def test_load_in_order_with_params_and_flags(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, 'a.ko'), os.path.join(d, 'b.ko.zst')
            for p in (a, b):
                open(p, 'wb').close()
            listing = os.path.join(d, 'modules')
            with open(listing, 'w') as fh:
                fh.write('%s\n%s debug=1\n%s/missing.ko\n' % (a.lstrip('/'), b.lstrip('/'), d.lstrip('/')))
            calls = []

            def syscall(fd, params, flags):
                calls.append((os.readlink('/proc/self/fd/%d' % fd), params, flags))
                return 17 if len(calls) == 2 else 0  # EEXIST counts as loaded

            done = agent.load_modules(syscall, listing)
            self.assertEqual(calls, [(a, b'', 0), (b, b'debug=1', 4)])
            self.assertEqual(done, [a, b])

    def test_no_listing_is_fine(self):
        self.assertEqual(agent.load_modules(lambda *a: 0, '/nonexistent/modules'), [])


class Zombies(unittest.TestCase):
    def test_finds_an_unwaited_child(self):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        try:
            deadline = time.monotonic() + 5
            while pid not in agent.zombie_children(os.getpid()):
                self.assertLess(time.monotonic(), deadline, 'child never showed up as a zombie')
                time.sleep(0.01)
        finally:
            os.waitpid(pid, 0)
        self.assertNotIn(pid, agent.zombie_children(os.getpid()))


if __name__ == '__main__':
    unittest.main()
