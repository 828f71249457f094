"""The agent as a subprocess on a Unix socket, driven with raw frames (the
full behaviour is tested from TypeScript in test/unit/agent.test.ts)."""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import unittest

import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, 'guest-agent', 'forkling_agent.py')


class Client:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)

    def raw(self, data):
        self.s.sendall(data)

    def send(self, frame):
        p = msgpack.packb(frame, use_bin_type=True)
        self.s.sendall(struct.pack('>I', len(p)) + p)

    def _exact(self, n):
        b = b''
        while len(b) < n:
            k = self.s.recv(n - len(b))
            if not k:
                raise EOFError
            b += k
        return b

    def recv(self):
        (n,) = struct.unpack('>I', self._exact(4))
        return msgpack.unpackb(self._exact(n), raw=False)

    def call(self, frame):
        self.send(frame)
        return self.recv()


class AgentSmoke(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.path = os.path.join(cls.dir.name, 'a.sock')
        cls.proc = subprocess.Popen([sys.executable, AGENT, '--unix', cls.path], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        line = cls.proc.stdout.readline()
        assert line.startswith('forkling-agent ready'), line

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        cls.proc.wait(5)
        cls.proc.stdout.close()
        cls.proc.stderr.close()
        cls.dir.cleanup()

    def client(self):
        c = Client(self.path)
        r = c.call({'t': 'req', 'id': 1, 'op': 'hello', 'versions': [1, 99]})
        self.assertEqual(r['version'], 1)
        return c

    def test_hello_required_and_version(self):
        c = Client(self.path)
        self.assertEqual(c.call({'t': 'req', 'id': 1, 'op': 'ping'})['code'], 'hello_required')
        self.assertEqual(c.call({'t': 'req', 'id': 2, 'op': 'hello', 'versions': [99]})['code'], 'unsupported_version')
        self.assertEqual(c.call({'t': 'req', 'id': 3, 'op': 'hello', 'versions': [1]})['t'], 'res')

    def test_eval_with_output(self):
        c = self.client()
        c.send({'t': 'req', 'id': 2, 'op': 'eval', 'code': 'print("a")\n6*7'})
        ev = c.recv()
        self.assertEqual((ev['t'], ev['ev'], ev['data']), ('ev', 'stdout', 'a\n'))
        res = c.recv()
        self.assertEqual((res['t'], res['id'], res['value'], res['repr']), ('res', 2, 42, '42'))

    def test_bad_and_oversized_frames_keep_the_connection(self):
        c = self.client()
        c.raw(struct.pack('>I', 1) + b'\xc1')
        self.assertEqual(c.recv()['code'], 'bad_frame')
        n = (16 << 20) + 1
        c.raw(struct.pack('>I', n))
        c.raw(bytes(n))
        r = c.recv()
        self.assertEqual((r['code'], r['id']), ('frame_too_large', None))
        self.assertEqual(c.call({'t': 'req', 'id': 5, 'op': 'ping'})['t'], 'res')

    def test_exec(self):
        c = self.client()
        c.send({'t': 'req', 'id': 2, 'op': 'exec', 'argv': ['sh', '-c', 'printf hi; exit 4']})
        frames = []
        while True:
            f = c.recv()
            frames.append(f)
            if f['t'] != 'ev':
                break
        self.assertEqual(frames[0]['ev'], 'started')
        self.assertEqual(b''.join(f['data'] for f in frames if f.get('ev') == 'stdout'), b'hi')
        self.assertEqual(frames[-1]['exitCode'], 4)


if __name__ == '__main__':
    unittest.main()
