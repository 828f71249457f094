"""What CPython itself costs per forked child, without forkling: the floor
under bench/process-fork.ts's private memory per child. Run by
bench/python-floor.ts inside a sandbox of the image (its python3, numpy).

A warm parent (numpy imported, gc frozen, as a zygote) forks N children at
a time with libc's fork() (as the fork server does); each child does what
its row says, then waits; the parent reads each child's
Private_* from smaps_rollup while they all live. Batches of N: pages the
parent writes after a fork are shared by the whole batch, not one child's."""

import ast
import ctypes
import gc
import json
import os
import struct
import sys
import _thread

import msgpack
import numpy  # noqa: F401 - the warm-up

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
plain_fork = ctypes.PyDLL(None).fork
gc.collect()
gc.freeze()


def private_kib(pid):
    with open('/proc/%d/smaps_rollup' % pid) as f:
        return sum(int(l.split()[1]) for l in f if l.startswith('Private'))


def evaluate(code, ns):
    """As the agent: parse, split off a last expression, compile, run."""
    tree = ast.parse(code, '<cell>', 'exec')
    last = ast.Expression(tree.body.pop().value) if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if tree.body:
        exec(compile(tree, '<cell>', 'exec'), ns)
    return eval(compile(last, '<cell>', 'eval'), ns) if last is not None else None


def serve(r, w):
    """One request over a pipe, as a connection thread: a msgpack frame in, an eval, a frame out."""
    n = struct.unpack('>I', os.read(r, 4))[0]
    req = msgpack.unpackb(os.read(r, n), raw=False)
    out = msgpack.packb({'t': 'res', 'id': req['id'], 'value': evaluate(req['code'], {})}, use_bin_type=True)
    os.write(w, struct.pack('>I', len(out)) + out)


MODES = [
    ('fork, then wait', None),
    ('fork, start a thread that waits', 'thread'),
    ("fork, eval '1 + 1' as the agent does (ast.parse, compile, eval)", 'eval'),
    ('fork, a thread reads a msgpack request, evals it, answers', 'serve'),
]
warm = {}
evaluate('1 + 1', warm)  # caches filled in the parent, as the zygote's rehearsal does
msgpack.unpackb(msgpack.packb({'id': 1, 'code': '1 + 1'}), raw=False)
rows = []
for title, mode in MODES:
    gate_r, gate_w = os.pipe()      # children wait on it
    ready_r, ready_w = os.pipe()    # a byte per child when it is done
    pairs = [(os.pipe(), os.pipe()) for _ in range(N)] if mode == 'serve' else [None] * N
    pids = []
    for i in range(N):
        pid = plain_fork()
        if pid == 0:
            if mode == 'thread':
                _thread.start_new_thread(lambda: (os.write(ready_w, b'x'), os.read(gate_r, 1)), ())
            elif mode == 'eval':
                evaluate('1 + 1', {})
                os.write(ready_w, b'x')
            elif mode == 'serve':
                (req_r, _), (_, res_w) = pairs[i]
                _thread.start_new_thread(lambda: (serve(req_r, res_w), os.write(ready_w, b'x'), os.read(gate_r, 1)), ())
            else:
                os.write(ready_w, b'x')
            os.read(gate_r, 1)
            os._exit(0)
        pids.append(pid)
    if mode == 'serve':
        for i, ((_, req_w), (res_r, _)) in enumerate(pairs):
            body = msgpack.packb({'t': 'req', 'id': i, 'code': '1 + 1'}, use_bin_type=True)
            os.write(req_w, struct.pack('>I', len(body)) + body)
            n = struct.unpack('>I', os.read(res_r, 4))[0]
            assert msgpack.unpackb(os.read(res_r, n), raw=False)['value'] == 2
    for _ in range(N):
        os.read(ready_r, 1)
    kib = sorted(private_kib(p) for p in pids)
    os.write(gate_w, b'x' * 2 * N)
    for p in pids:
        os.waitpid(p, 0)
    for fd in (gate_r, gate_w, ready_r, ready_w):
        os.close(fd)
    for pr in pairs:
        if pr:
            for fd in pr[0] + pr[1]:
                os.close(fd)
    rows.append({'what': title, 'median_kib': kib[len(kib) // 2], 'max_kib': kib[-1]})
print(json.dumps({'python': sys.version.split()[0], 'n': N, 'rows': rows}))
