"""What CPython itself costs per forked child, without forkling: the floor
under bench/process-fork.ts's private memory per child. Run by
bench/python-floor.ts inside a sandbox of the image (its python3, numpy).

A warm parent (numpy imported, gc frozen, as a zygote) forks N children at
a time with libc's fork() (as the fork server does); each child does what
its row says, then waits; the parent reads each child's
Private_* from smaps_rollup while they all live. Batches of N: pages the
parent writes after a fork are shared by the whole batch, not one child's.

With the path of the process engine's guest-agent/forkling_reclaim.so
(argument 2), two more rows, after the parent's memory is made a file's
(fr_remap): a child that serves one request and whose thread has ended,
without and with fr_reclaim (its pages equal to the file's given back)
before it waits."""

import ast
import ctypes
import gc
import json
import mmap
import os
import struct
import sys
import time
import _thread

import msgpack
import numpy  # noqa: F401 - the warm-up

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
RECLAIM_SO = sys.argv[2] if len(sys.argv) > 2 else None
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


def serve_then_end(req_r, res_w):
    """serve() in a thread; returns once that thread has ended (this process has one thread again)."""
    done_r, done_w = os.pipe()
    _thread.start_new_thread(lambda: (serve(req_r, res_w), os.write(done_w, b'x')), ())
    os.read(done_r, 1)
    while len(os.listdir('/proc/self/task')) > 1:
        time.sleep(0.001)


MODES = [
    ('fork, then wait', None),
    ('fork, start a thread that waits', 'thread'),
    ("fork, eval '1 + 1' as the agent does (ast.parse, compile, eval)", 'eval'),
    ('fork, a thread reads a msgpack request, evals it, answers', 'serve'),
]
RECLAIM_MODES = [
    ("parent's memory a file's: fork, a thread serves one request and ends", 'serve-end'),
    ('the same, then gives back its pages equal to the file (fr_reclaim) and waits', 'serve-end-reclaim'),
]
warm = {}
evaluate('1 + 1', warm)  # caches filled in the parent, as the zygote's rehearsal does
msgpack.unpackb(msgpack.packb({'id': 1, 'code': '1 + 1'}), raw=False)
rows = []
remap = None
for title, mode in MODES + (RECLAIM_MODES if RECLAIM_SO else []):
    if mode == 'serve-end':  # (the last rows: the parent stays a file's)
        lib = ctypes.CDLL(RECLAIM_SO)
        for fn in (lib.fr_remap, lib.fr_reclaim, lib.fr_state_size):
            fn.restype = ctypes.c_long
        state = mmap.mmap(-1, lib.fr_state_size(), flags=mmap.MAP_PRIVATE)  # (mappings of its own: not made a file's)
        scratch = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE)
        state_p = ctypes.addressof(ctypes.c_char.from_buffer(state))
        before = private_kib(os.getpid())
        t0 = time.monotonic()
        copied = lib.fr_remap(ctypes.c_void_p(state_p), ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(scratch))),
                              ctypes.c_long(len(scratch)), ctypes.c_long(200))
        if copied < 0:
            raise OSError(-copied, 'fr_remap: ' + os.strerror(-copied))
        remap = {'ms': round((time.monotonic() - t0) * 1000, 1), 'file_kib': copied // 1024,
                 'parent_private_kib': [before, private_kib(os.getpid())]}
    gate_r, gate_w = os.pipe()      # children wait on it
    ready_r, ready_w = os.pipe()    # a byte per child when it is done
    serving = mode is not None and mode.startswith('serve')
    pairs = [(os.pipe(), os.pipe()) for _ in range(N)] if serving else [None] * N
    given_back = []
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
            elif serving:
                (req_r, _), (_, res_w) = pairs[i]
                serve_then_end(req_r, res_w)
                back = lib.fr_reclaim(ctypes.c_void_p(state_p), ctypes.c_long(200)) if mode.endswith('reclaim') else 0
                if back < 0:
                    os._exit(4)
                os.write(ready_w, struct.pack('i', back))
                os.read(gate_r, 1)
                os._exit(0 if evaluate('int(numpy.arange(10).sum())', {'numpy': numpy}) == 45 else 3)  # all still there
            else:
                os.write(ready_w, b'x')
            os.read(gate_r, 1)
            os._exit(0)
        pids.append(pid)
    if serving:
        for i, ((_, req_w), (res_r, _)) in enumerate(pairs):
            body = msgpack.packb({'t': 'req', 'id': i, 'code': '1 + 1'}, use_bin_type=True)
            os.write(req_w, struct.pack('>I', len(body)) + body)
            n = struct.unpack('>I', os.read(res_r, 4))[0]
            assert msgpack.unpackb(os.read(res_r, n), raw=False)['value'] == 2
    for _ in range(N):
        if serving and mode != 'serve':
            given_back.append(struct.unpack('i', os.read(ready_r, 4))[0])
        else:
            os.read(ready_r, 1)
    kib = sorted(private_kib(p) for p in pids)
    os.write(gate_w, b'x' * 2 * N)
    for p in pids:
        status = os.waitpid(p, 0)[1]
        if status != 0:
            raise RuntimeError('child %d ended with status %d (its memory was not intact)' % (p, status))
    for fd in (gate_r, gate_w, ready_r, ready_w):
        os.close(fd)
    for pr in pairs:
        if pr:
            for fd in pr[0] + pr[1]:
                os.close(fd)
    row = {'what': title, 'median_kib': kib[len(kib) // 2], 'max_kib': kib[-1]}
    if mode == 'serve-end-reclaim':
        row['given_back_kib'] = sorted(given_back)[N // 2] * 4
    rows.append(row)
print(json.dumps({'python': sys.version.split()[0], 'n': N, 'rows': rows, 'remap': remap}))
