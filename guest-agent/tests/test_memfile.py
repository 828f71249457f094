"""forkling_memfile.when_idle: when a fork gives back its pages (once per
quiet spell of QUIET_TICKS ticks with no client frame and nothing running;
a try that gave up, QUIET_TICKS later again), and when it stops trying (three give-ups in a row, or a handler of sandbox
code's own for SIGRTMAX). The library is a stand-in here: what it does is
tested in test_reclaim.py."""

import errno
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import forkling_memfile as memfile  # noqa: E402


class FakeLib:
    """fr_reclaim_wait answers from a list (the last answer repeats); calls are counted."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0

    def fr_reclaim_wait(self, st, wait_ms, fds, nfds, publish):
        self.calls += 1
        self.waited, self.published = [fds[i] for i in range(2 * nfds)], publish
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class WhenIdleTest(unittest.TestCase):
    def setUp(self):
        self.saved = dict(memfile.STATE)
        self.logged = []

    def tearDown(self):
        memfile.STATE.clear()
        memfile.STATE.update(self.saved)

    def use(self, answers):
        lib = FakeLib(answers)
        memfile.STATE.update(lib=lib, st=1, seen=-1, done_at=-1, timeouts=0, quiet=0)
        return lib

    def ticks(self, n, activity, idle=True):
        for _ in range(n):
            memfile.when_idle(activity, idle, self.logged.append)

    def spell(self, activity):
        """A new client frame, then a whole quiet spell."""
        self.ticks(memfile.QUIET_TICKS + 1, activity)

    def test_once_per_quiet_spell(self):
        lib = self.use([5])
        self.ticks(memfile.QUIET_TICKS, 1)  # (the first tick sees the count change: not quiet yet)
        self.assertEqual(lib.calls, 0)
        self.ticks(1, 1)
        self.assertEqual(lib.calls, 1)
        self.ticks(3 * memfile.QUIET_TICKS, 1)  # still the same spell: nothing more to give back
        self.assertEqual(lib.calls, 1)
        self.ticks(2 * memfile.QUIET_TICKS, 2, idle=False)  # an eval running: not quiet
        self.assertEqual(lib.calls, 1)
        self.spell(2)
        self.assertEqual(lib.calls, 2)
        self.assertEqual(self.logged, [])

    def test_it_says_when_nothing_is_left_to_give_back(self):
        lib = self.use([5])
        said = [memfile.when_idle(1, True, self.logged.append) for _ in range(memfile.QUIET_TICKS)]
        self.assertEqual(said, [False] * memfile.QUIET_TICKS)  # (the caller keeps ticking)
        # the reclaim, with fds given: it sleeps in the same call, on those fds (struct pollfd, POLLIN)
        self.assertTrue(memfile.when_idle(1, True, self.logged.append, [7, 9]))
        self.assertEqual((lib.calls, lib.waited), (1, [7, 1, 9, 1]))
        self.assertTrue(memfile.when_idle(1, True, self.logged.append))  # nothing more this spell
        self.assertFalse(memfile.when_idle(2, True, self.logged.append))  # a client frame: a new spell
        self.assertFalse(memfile.when_idle(2, False, self.logged.append))

    def test_a_give_up_is_not_settled_and_off_is_settled_when_idle(self):
        self.use([-errno.ETIMEDOUT])
        self.ticks(memfile.QUIET_TICKS, 1)
        self.assertFalse(memfile.when_idle(1, True, self.logged.append), 'tried again later: keep ticking')
        memfile.STATE['lib'] = None  # reclaim off: settled once a whole tick was quiet (no frame, nothing running)
        self.assertEqual([memfile.when_idle(a, idle, self.logged.append) for a, idle in ((1, True), (1, False), (1, True), (2, True), (2, True))],
                         [True, False, True, False, True])

    def test_three_give_ups_in_a_row_stop_it(self):
        lib = self.use([-errno.ETIMEDOUT])
        for activity in (1, 2):
            self.spell(activity)
        self.assertIsNotNone(memfile.STATE['lib'])
        self.assertEqual(self.logged, [])
        self.spell(3)
        self.assertEqual(lib.calls, 3)
        self.assertIsNone(memfile.STATE['lib'])
        self.assertEqual(len(self.logged), 1)
        self.assertIn(os.strerror(errno.ETIMEDOUT), self.logged[0])
        self.spell(4)
        self.assertEqual(lib.calls, 3)

    def test_a_give_up_is_tried_again_in_the_same_spell(self):
        lib = self.use([-errno.ETIMEDOUT, 5])
        self.spell(1)
        self.assertEqual(lib.calls, 1)
        self.ticks(memfile.QUIET_TICKS - 1, 1)
        self.assertEqual(lib.calls, 1, 'not at once: QUIET_TICKS later')
        self.ticks(1, 1)
        self.assertEqual(lib.calls, 2)
        self.ticks(3 * memfile.QUIET_TICKS, 1)  # given back: nothing more in this spell
        self.assertEqual(lib.calls, 2)
        self.assertEqual((self.logged, memfile.STATE['timeouts']), ([], 0))

    def test_a_success_between_give_ups_starts_the_count_again(self):
        lib = self.use([-errno.ETIMEDOUT, -errno.ETIMEDOUT, 7, -errno.ETIMEDOUT, -errno.ETIMEDOUT, 7])
        for activity in range(1, 7):
            self.spell(activity)
        self.assertEqual(lib.calls, 6)
        self.assertIsNotNone(memfile.STATE['lib'])
        self.assertEqual(self.logged, [])

    def test_sandbox_code_taking_the_signal_stops_it_at_once(self):
        lib = self.use([-errno.EEXIST])
        self.spell(1)
        self.assertIsNone(memfile.STATE['lib'])
        self.assertEqual(self.logged, ['this sandbox stops giving back the pages it copied: sandbox code has a handler for SIGRTMAX'])
        self.spell(2)
        self.assertEqual(lib.calls, 1)


if __name__ == '__main__':
    unittest.main()
