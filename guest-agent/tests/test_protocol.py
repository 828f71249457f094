"""Protocol checks on the Python side: golden vectors, the embedded schema,
the validator, value conversion. Run: /usr/bin/python3 -m unittest discover guest-agent/tests"""

import importlib.util
import json
import os
import sys
import unittest

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def load_agent():
    # as in an image: the agent finds its optional companion modules next to it
    sys.path.insert(0, os.path.join(ROOT, 'guest-agent'))
    spec = importlib.util.spec_from_file_location('forkling_agent', os.path.join(ROOT, 'guest-agent', 'forkling_agent.py'))
    mod = importlib.util.module_from_spec(spec)
    sys.modules['forkling_agent'] = mod
    spec.loader.exec_module(mod)
    return mod


agent = load_agent()


def from_json(v):
    if isinstance(v, dict):
        if set(v) == {'$bin'}:
            return bytes.fromhex(v['$bin'])
        return {k: from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json(x) for x in v]
    return v


with open(os.path.join(ROOT, 'protocol', 'vectors', 'frames.json')) as fh:
    VECTORS = json.load(fh)


class GoldenVectors(unittest.TestCase):
    def test_frames_decode_to_their_meaning(self):
        self.assertGreater(len(VECTORS['frames']), 10)
        for v in VECTORS['frames']:
            with self.subTest(v['name']):
                decoded = msgpack.unpackb(bytes.fromhex(v['hex']), raw=False)
                self.assertEqual(decoded, from_json(v['frame']))

    def test_frames_encode_to_the_same_bytes(self):
        for v in VECTORS['frames']:
            if v.get('pySameBytes') is False:
                continue
            with self.subTest(v['name']):
                self.assertEqual(msgpack.packb(from_json(v['frame']), use_bin_type=True).hex(), v['hex'])

    def test_client_frames_are_valid(self):
        for v in VECTORS['frames']:
            if v['from'] != 'client':
                continue
            with self.subTest(v['name']):
                frame, bad = agent.decode_payload(bytes.fromhex(v['hex']))
                self.assertIsNone(bad)
                self.assertIsNone(agent.validate_client_frame(frame))

    def test_invalid_frames_get_the_expected_error(self):
        self.assertGreater(len(VECTORS['invalid']), 8)
        for v in VECTORS['invalid']:
            with self.subTest(v['name']):
                frame, bad = agent.decode_payload(bytes.fromhex(v['hex']))
                if bad is None:
                    bad = agent.validate_client_frame(frame)
                self.assertIsNotNone(bad, 'accepted an invalid frame')
                _, code, message = bad
                self.assertEqual(code, v['code'], message)
                if v['field']:
                    self.assertIn('field %s' % v['field'], message)


class EmbeddedSchema(unittest.TestCase):
    def test_agent_schema_matches_protocol_schema_json(self):
        with open(os.path.join(ROOT, 'protocol', 'schema.json')) as fh:
            self.assertEqual(agent.SCHEMA, json.load(fh), 'run: npx tsx protocol/gen.ts')

    def test_every_schema_op_has_a_handler_and_back(self):
        self.assertEqual(set(agent.SCHEMA['ops']), set(agent.OPS))

    def test_limits(self):
        self.assertEqual(agent.MAX_FRAME, 16 << 20)
        self.assertEqual(agent.MAX_CHUNK, 1 << 20)


class Validator(unittest.TestCase):
    def args(self, op):
        return agent.SCHEMA['ops'][op]['args']

    def test_accepts_and_rejects(self):
        s = self.args('exec')
        self.assertIsNone(agent.check(s, {'argv': ['ls', '-l'], 'env': {'A': 'b'}, 'stdin': b'x'}))
        self.assertIn('/argv: expected at least 1 items', agent.check(s, {'argv': []}))
        self.assertIn('/stdin: expected bytes', agent.check(s, {'stdin': 'text'}))
        self.assertIn('/timeoutMs', agent.check(s, {'timeoutMs': 1.5}))
        self.assertIn('/clearEnv: expected boolean', agent.check(s, {'clearEnv': 1}))

    def test_bool_is_not_an_integer(self):
        self.assertIn('/timeoutMs', agent.check(self.args('eval'), {'code': '1', 'timeoutMs': True}))

    def test_union_and_null(self):
        s = self.args('proc.signal')
        self.assertIsNone(agent.check(s, {'procId': 'p1', 'signal': 'TERM'}))
        self.assertIsNone(agent.check(s, {'procId': 'p1', 'signal': 9}))
        self.assertIn('/signal', agent.check(s, {'procId': 'p1', 'signal': [9]}))

    def test_chunk_limit(self):
        ev = agent.SCHEMA['clientEvents']['data']
        self.assertIsNone(agent.check(ev, {'data': bytes(1 << 20)}))
        self.assertIn('at most 1048576 bytes', agent.check(ev, {'data': bytes((1 << 20) + 1)}))


class Values(unittest.TestCase):
    def wire(self, v):
        return agent._to_wire(v, [agent.VALUE_MAX_ITEMS, agent.VALUE_MAX_BYTES])

    def test_plain_data(self):
        v = {'a': [1, 2.5, None, True, 'x', b'\x00'], 'b': (1, 2)}
        self.assertEqual(self.wire(v), {'a': [1, 2.5, None, True, 'x', b'\x00'], 'b': [1, 2]})

    def test_not_representable(self):
        for v in (object(), {1: 2}, 1 << 70, {1, 2}):
            with self.subTest(repr(v)):
                with self.assertRaises(ValueError):
                    self.wire(v)

    def test_numpy_like_values_become_lists(self):
        class ndarray:
            __module__ = 'numpy'
            size = 3

            def tolist(self):
                return [[1, 2], [3.5]]
        self.assertEqual(self.wire(ndarray()), [[1, 2], [3.5]])

    def test_budget(self):
        with self.assertRaises(ValueError):
            self.wire(list(range(agent.VALUE_MAX_ITEMS + 5)))
        with self.assertRaises(ValueError):
            self.wire(['x' * (agent.VALUE_MAX_BYTES // 2)] * 3)

    def test_repr_is_bounded_and_safe(self):
        class Bad:
            def __repr__(self):
                raise RuntimeError('no')
        self.assertEqual(agent._safe_repr(Bad()), '<repr failed: RuntimeError>')
        self.assertLess(len(agent._safe_repr('x' * (agent.REPR_MAX * 2))), agent.REPR_MAX + 100)


if __name__ == '__main__':
    unittest.main()
