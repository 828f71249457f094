#!/usr/bin/python3
"""forkling guest agent: PID 1 of every sandbox, and the warm Python interpreter.

Speaks the forkling wire protocol (protocol/PROTOCOL.md): length-prefixed
msgpack frames on an AF_VSOCK port (as PID 1) or a Unix socket (--unix PATH).
Standard library + python3-msgpack only; this one file is copied into images
as /init.

Threads: `eval` runs in the main thread, one at a time, so that a timeout or a
cancel can interrupt it with SIGINT (KeyboardInterrupt), which also breaks
blocking calls such as time.sleep() or socket reads -- an asynchronous
exception in a worker thread would not. Everything else (accepting, reading
frames, processes, files) runs in other threads. All agent state hangs off
one Agent object (a later zygote `fork` op can rebuild listeners and
connections in the child from it).

Usage: forkling_agent.py [--unix PATH] [--vsock PORT] [--max-memory BYTES]
                         [--system-ops entropy,clock,hostname|none|all]
"""

import _thread
import ast
import codecs
import errno
import faulthandler
import fcntl
import json
import linecache
import os
import queue
import random  # imported up front: restore must stay under 1 ms
import select
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
import traceback

import msgpack

AGENT_VERSION = '0.1.0'
PROTOCOL_VERSIONS = (1,)
IS_PID1 = os.getpid() == 1
DEFAULT_VSOCK_PORT = 1024

# --- BEGIN GENERATED SCHEMA (protocol/gen.ts; do not edit) ---
SCHEMA_JSON = "{\"version\":1,\"limits\":{\"maxFrame\":16777216,\"maxChunk\":1048576,\"maxCode\":4194304},\"frames\":{\"req\":{\"type\":\"object\",\"required\":[\"t\",\"id\",\"op\"],\"properties\":{\"t\":{\"const\":\"req\",\"type\":\"string\"},\"id\":{\"minimum\":0,\"maximum\":4294967295,\"type\":\"integer\"},\"op\":{\"minLength\":1,\"maxLength\":64,\"type\":\"string\"}}},\"ev\":{\"type\":\"object\",\"required\":[\"t\",\"id\",\"ev\"],\"properties\":{\"t\":{\"const\":\"ev\",\"type\":\"string\"},\"id\":{\"minimum\":0,\"maximum\":4294967295,\"type\":\"integer\"},\"ev\":{\"minLength\":1,\"maxLength\":64,\"type\":\"string\"}}},\"cancel\":{\"type\":\"object\",\"required\":[\"t\",\"id\"],\"properties\":{\"t\":{\"const\":\"cancel\",\"type\":\"string\"},\"id\":{\"minimum\":0,\"maximum\":4294967295,\"type\":\"integer\"}}}},\"clientEvents\":{\"data\":{\"type\":\"object\",\"required\":[\"data\"],\"properties\":{\"data\":{\"maxByteLength\":1048576,\"type\":\"Uint8Array\"}}},\"end\":{\"type\":\"object\",\"properties\":{}}},\"ops\":{\"hello\":{\"args\":{\"type\":\"object\",\"required\":[\"versions\"],\"properties\":{\"versions\":{\"minItems\":1,\"maxItems\":16,\"type\":\"array\",\"items\":{\"minimum\":1,\"maximum\":65535,\"type\":\"integer\"}},\"client\":{\"maxLength\":256,\"type\":\"string\"}}},\"clientStream\":false},\"ping\":{\"args\":{\"type\":\"object\",\"properties\":{}},\"clientStream\":false},\"info\":{\"args\":{\"type\":\"object\",\"properties\":{\"modules\":{\"type\":\"boolean\"}}},\"clientStream\":false},\"quiet\":{\"args\":{\"type\":\"object\",\"properties\":{}},\"clientStream\":false},\"eval\":{\"args\":{\"type\":\"object\",\"required\":[\"code\"],\"properties\":{\"code\":{\"maxLength\":4194304,\"type\":\"string\"},\"context\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"},\"timeoutMs\":{\"minimum\":0,\"maximum\":31536000000,\"type\":\"integer\"}}},\"clientStream\":false},\"context.list\":{\"args\":{\"type\":\"object\",\"properties\":{}},\"clientStream\":false},\"context.delete\":{\"args\":{\"type\":\"object\",\"required\":[\"context\"],\"properties\":{\"context\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"}}},\"clientStream\":false},\"exec\":{\"args\":{\"type\":\"object\",\"properties\":{\"argv\":{\"minItems\":1,\"maxItems\":65536,\"type\":\"array\",\"items\":{\"maxLength\":131072,\"type\":\"string\"}},\"shell\":{\"maxLength\":131072,\"type\":\"string\"},\"env\":{\"type\":\"object\",\"patternProperties\":{\"^(.*)$\":{\"type\":\"string\"}}},\"clearEnv\":{\"type\":\"boolean\"},\"cwd\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"stdin\":{\"maxByteLength\":1048576,\"type\":\"Uint8Array\"},\"stdinStream\":{\"type\":\"boolean\"},\"timeoutMs\":{\"minimum\":0,\"maximum\":31536000000,\"type\":\"integer\"},\"background\":{\"type\":\"boolean\"}}},\"clientStream\":true},\"proc.list\":{\"args\":{\"type\":\"object\",\"properties\":{}},\"clientStream\":false},\"proc.wait\":{\"args\":{\"type\":\"object\",\"required\":[\"procId\"],\"properties\":{\"procId\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"},\"timeoutMs\":{\"minimum\":0,\"maximum\":31536000000,\"type\":\"integer\"}}},\"clientStream\":false},\"proc.write\":{\"args\":{\"type\":\"object\",\"required\":[\"procId\",\"data\"],\"properties\":{\"procId\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"},\"data\":{\"maxByteLength\":1048576,\"type\":\"Uint8Array\"}}},\"clientStream\":false},\"proc.closeStdin\":{\"args\":{\"type\":\"object\",\"required\":[\"procId\"],\"properties\":{\"procId\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"}}},\"clientStream\":false},\"proc.signal\":{\"args\":{\"type\":\"object\",\"required\":[\"procId\",\"signal\"],\"properties\":{\"procId\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"},\"signal\":{\"anyOf\":[{\"maxLength\":16,\"type\":\"string\"},{\"minimum\":1,\"maximum\":64,\"type\":\"integer\"}]},\"group\":{\"type\":\"boolean\"}}},\"clientStream\":false},\"proc.kill\":{\"args\":{\"type\":\"object\",\"required\":[\"procId\"],\"properties\":{\"procId\":{\"minLength\":1,\"maxLength\":256,\"type\":\"string\"}}},\"clientStream\":false},\"files.read\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"offset\":{\"minimum\":0,\"type\":\"integer\"},\"length\":{\"minimum\":0,\"type\":\"integer\"}}},\"clientStream\":false},\"files.write\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"data\":{\"maxByteLength\":1048576,\"type\":\"Uint8Array\"},\"stream\":{\"type\":\"boolean\"},\"append\":{\"type\":\"boolean\"},\"mode\":{\"minimum\":0,\"maximum\":4095,\"type\":\"integer\"},\"mkdirs\":{\"type\":\"boolean\"}}},\"clientStream\":true},\"files.list\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"}}},\"clientStream\":false},\"files.stat\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"follow\":{\"type\":\"boolean\"}}},\"clientStream\":false},\"files.exists\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"}}},\"clientStream\":false},\"files.mkdir\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"parents\":{\"type\":\"boolean\"},\"mode\":{\"minimum\":0,\"maximum\":4095,\"type\":\"integer\"}}},\"clientStream\":false},\"files.remove\":{\"args\":{\"type\":\"object\",\"required\":[\"path\"],\"properties\":{\"path\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"recursive\":{\"type\":\"boolean\"},\"force\":{\"type\":\"boolean\"}}},\"clientStream\":false},\"files.rename\":{\"args\":{\"type\":\"object\",\"required\":[\"from\",\"to\"],\"properties\":{\"from\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"},\"to\":{\"minLength\":1,\"maxLength\":4096,\"type\":\"string\"}}},\"clientStream\":false},\"restore\":{\"args\":{\"type\":\"object\",\"properties\":{\"entropy\":{\"maxByteLength\":4096,\"type\":\"Uint8Array\"},\"time\":{\"minimum\":0,\"type\":\"number\"},\"hostname\":{\"minLength\":1,\"maxLength\":64,\"type\":\"string\"},\"sandboxId\":{\"minLength\":1,\"maxLength\":128,\"type\":\"string\"}}},\"clientStream\":false},\"shutdown\":{\"args\":{\"type\":\"object\",\"properties\":{\"reboot\":{\"type\":\"boolean\"}}},\"clientStream\":false},\"fork\":{\"args\":{\"type\":\"object\",\"required\":[\"children\"],\"properties\":{\"children\":{\"minItems\":0,\"maxItems\":1024,\"type\":\"array\",\"items\":{\"type\":\"object\",\"required\":[\"id\",\"hostname\"],\"properties\":{\"id\":{\"minLength\":1,\"maxLength\":32,\"type\":\"string\"},\"hostname\":{\"minLength\":1,\"maxLength\":63,\"type\":\"string\"}}}}}},\"clientStream\":false},\"branch\":{\"args\":{\"type\":\"object\",\"required\":[\"children\"],\"properties\":{\"children\":{\"minItems\":0,\"maxItems\":1024,\"type\":\"array\",\"items\":{\"type\":\"object\",\"required\":[\"id\",\"hostname\"],\"properties\":{\"id\":{\"minLength\":1,\"maxLength\":32,\"type\":\"string\"},\"hostname\":{\"minLength\":1,\"maxLength\":63,\"type\":\"string\"}}}},\"hold\":{\"type\":\"boolean\"}}},\"clientStream\":false}},\"errorCodes\":[\"bad_frame\",\"frame_too_large\",\"bad_request\",\"unknown_op\",\"hello_required\",\"unsupported_version\",\"duplicate_id\",\"unknown_request\",\"cancelled\",\"not_found\",\"already_exists\",\"permission_denied\",\"not_a_directory\",\"is_a_directory\",\"not_empty\",\"io_error\",\"no_such_process\",\"resource_exhausted\",\"shutting_down\",\"internal\"]}"
# --- END GENERATED SCHEMA ---

SCHEMA = json.loads(SCHEMA_JSON)
LIMITS = SCHEMA.get('limits', {})
MAX_FRAME = LIMITS.get('maxFrame', 16 << 20)
MAX_CHUNK = LIMITS.get('maxChunk', 1 << 20)
OUTPUT_READ = 64 << 10  # process output read size (one event at most this big)
TAIL_KEEP = 64 << 10  # process output kept for proc.wait
EVAL_FLUSH_BYTES = 32 << 10  # eval output flushed when this much is buffered...
EVAL_FLUSH_S = 0.02  # ...or after this long
EVAL_BUFFER_MAX = 8 << 20  # a print() waits while this much is unsent
FD_LOOK_AFTER_NS = 50_000  # a print this long after the last one first takes what fds 1 and 2 got (FdCapture)
FORKED_BUFFER_CHARS = 8192  # a forked process's text with no newline is written once this much waits (or at flush/exit)
REPR_MAX = 256 << 10
TRACEBACK_MAX = 1 << 20
SEND_TIMEOUT_S = 60  # a send blocked this long (client not reading) closes the connection
VALUE_MAX_ITEMS = 100000
VALUE_MAX_BYTES = 2 << 20  # str characters (up to 4 bytes each) + bytes in a value
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the kernel's CRNG from its input pool now


def log(msg):
    try:
        sys.__stderr__.write('forkling-agent: %s\n' % msg)
        sys.__stderr__.flush()
    except Exception:
        pass


# ------------------------------------------------------------------ validation
# A JSON Schema subset: exactly what TypeBox emits for protocol/schema.ts.

_TYPE_CHECKS = {
    'object': lambda v: isinstance(v, dict),
    'array': lambda v: isinstance(v, (list, tuple)),
    'string': lambda v: isinstance(v, str),
    'integer': lambda v: isinstance(v, int) and not isinstance(v, bool),
    'number': lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    'boolean': lambda v: isinstance(v, bool),
    'null': lambda v: v is None,
    'Uint8Array': lambda v: isinstance(v, (bytes, bytearray)),
}
_TYPE_NAMES = {'Uint8Array': 'bytes (msgpack bin)', 'object': 'map'}


def check(schema, value, path=''):
    """Returns None when valid, else 'field /path: problem'."""
    where = path or '/'
    if 'anyOf' in schema:
        for alt in schema['anyOf']:
            if check(alt, value, path) is None:
                return None
        kinds = [a.get('type', '?') if 'const' not in a else repr(a['const']) for a in schema['anyOf']]
        return 'field %s: expected %s' % (where, ' or '.join(_TYPE_NAMES.get(k, k) for k in kinds))
    t = schema.get('type')
    if t is not None and not _TYPE_CHECKS[t](value):
        return 'field %s: expected %s' % (where, _TYPE_NAMES.get(t, t))
    if 'const' in schema and value != schema['const']:
        return 'field %s: expected %r' % (where, schema['const'])
    if t == 'object':
        props = schema.get('properties', {})
        for name in schema.get('required', ()):
            if name not in value:
                return 'field %s/%s: required property missing' % (path, name)
        for name, sub in props.items():
            if name in value:
                err = check(sub, value[name], '%s/%s' % (path, name))
                if err:
                    return err
        pattern = schema.get('patternProperties')
        if pattern:
            sub = next(iter(pattern.values()))
            for k, v in value.items():
                if not isinstance(k, str):
                    return 'field %s: keys must be strings' % where
                err = check(sub, v, '%s/%s' % (path, k))
                if err:
                    return err
    elif t == 'array':
        if len(value) < schema.get('minItems', 0):
            return 'field %s: expected at least %d items' % (where, schema['minItems'])
        if 'maxItems' in schema and len(value) > schema['maxItems']:
            return 'field %s: expected at most %d items' % (where, schema['maxItems'])
        items = schema.get('items')
        if items:
            for i, v in enumerate(value):
                err = check(items, v, '%s/%d' % (path, i))
                if err:
                    return err
    elif t == 'string':
        if len(value) < schema.get('minLength', 0):
            return 'field %s: expected at least %d characters' % (where, schema['minLength'])
        if 'maxLength' in schema and len(value) > schema['maxLength']:
            return 'field %s: expected at most %d characters' % (where, schema['maxLength'])
    elif t in ('integer', 'number'):
        if 'minimum' in schema and value < schema['minimum']:
            return 'field %s: expected a number >= %s' % (where, schema['minimum'])
        if 'maximum' in schema and value > schema['maximum']:
            return 'field %s: expected a number <= %s' % (where, schema['maximum'])
    elif t == 'Uint8Array':
        if 'maxByteLength' in schema and len(value) > schema['maxByteLength']:
            return 'field %s: expected at most %d bytes' % (where, schema['maxByteLength'])
    return None


# ------------------------------------------------------------------ errors


class OpError(Exception):
    """An error answered with an `err` frame: code, message, extra fields."""

    def __init__(self, code, message, **details):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
        self.details = details


_ERRNO_CODES = {
    errno.ENOENT: 'not_found',
    errno.EEXIST: 'already_exists',
    errno.EACCES: 'permission_denied',
    errno.EPERM: 'permission_denied',
    errno.ENOTDIR: 'not_a_directory',
    errno.EISDIR: 'is_a_directory',
    errno.ENOTEMPTY: 'not_empty',
}


def os_error(e, path=None):
    code = _ERRNO_CODES.get(e.errno, 'io_error')
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else 'EIO'
    target = path or e.filename
    msg = '%s: %s' % (target, e.strerror) if target else (e.strerror or str(e))
    return OpError(code, msg, errno=name, path=target if isinstance(target, str) else None)


# ------------------------------------------------------------------ connections


class Connection:
    """One client: a reader thread, a send lock, and the requests it has open."""

    def __init__(self, agent, sock, peer):
        self.agent = agent
        self.sock = sock
        self.peer = peer
        self.send_lock = threading.Lock()
        self.open = {}  # request id -> handle with .cancel() and maybe .on_input(ev, frame)
        self.open_lock = threading.Lock()
        self.hello = False
        self.closed = False
        try:  # a client that stops reading must not block the eval thread forever
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack('ll', SEND_TIMEOUT_S, 0))
        except (OSError, TypeError):  # TypeError: CPython takes only int option values on AF_VSOCK sockets
            pass

    # -- sending
    def send(self, frame):
        """Sends one frame; False when the connection is gone (the caller stops)."""
        if self.closed:
            return False
        try:
            payload = msgpack.packb(frame, use_bin_type=True)
        except Exception as e:  # a value that cannot be encoded: answer instead of dropping
            payload = msgpack.packb(self._err_frame(frame.get('id'), 'internal', 'cannot encode response: %s' % e))
        if len(payload) > MAX_FRAME:
            payload = msgpack.packb(self._err_frame(frame.get('id'), 'resource_exhausted',
                                                    'response of %d bytes exceeds the frame limit' % len(payload)))
        head = struct.pack('>I', len(payload))
        try:
            with self.send_lock:
                if len(payload) < 65536:
                    self.sock.sendall(head + payload)
                else:
                    self.sock.sendall(head)
                    self.sock.sendall(payload)
            return True
        except OSError:
            self.close()
            return False

    @staticmethod
    def _err_frame(req_id, code, message, **details):
        f = {'t': 'err', 'id': req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else None,
             'code': code, 'message': message}
        for k, v in details.items():
            if v is not None:
                f[k] = v
        return f

    def error(self, req_id, code, message, **details):
        return self.send(self._err_frame(req_id, code, message, **details))

    def register(self, req_id, handle):
        with self.open_lock:
            self.open[req_id] = handle

    def finish(self, req_id, frame):
        """Sends the final frame of a request and forgets it."""
        with self.open_lock:
            self.open.pop(req_id, None)
        return self.send(frame)

    def finish_error(self, req_id, code, message, **details):
        return self.finish(req_id, self._err_frame(req_id, code, message, **details))

    # -- receiving
    def _recv_exact(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                return None
            got += k
        return buf

    def _skip(self, n):
        scratch = bytearray(min(n, 1 << 20))
        while n > 0:
            k = self.sock.recv_into(scratch, min(n, len(scratch)))
            if k == 0:
                return False
            n -= k
        return True

    def run(self):
        try:
            while not self.closed:
                head = self._recv_exact(4)
                if head is None:
                    break
                (n,) = struct.unpack('>I', head)
                if n > MAX_FRAME:
                    self.error(None, 'frame_too_large', 'frame of %d bytes exceeds the limit of %d bytes; skipped'
                               % (n, MAX_FRAME), length=n, limit=MAX_FRAME)
                    if not self._skip(n):
                        break
                    continue
                if n == 0:
                    self.error(None, 'bad_frame', 'empty frame')
                    continue
                payload = self._recv_exact(n)
                if payload is None:
                    break
                frame, bad = decode_payload(payload)
                del payload
                if bad:
                    self.error(*bad)
                    continue
                try:
                    self.dispatch(frame)
                except MemoryError:
                    self.error(_frame_id(frame), 'resource_exhausted', 'out of memory')
        except OSError:
            pass
        except Exception as e:
            log('connection %s: %r' % (self.peer, e))
        finally:
            self.close()

    def dispatch(self, frame):
        agent = self.agent
        agent.frames += 1
        if agent.service_asleep:  # (read after the count: see sleep_kids)
            agent.service_asleep = False
            try:
                os.eventfd_write(agent.service_wake_fd, 1)
            except OSError:
                pass
        bad = validate_client_frame(frame)
        if bad:
            return self.error(*bad)
        t, req_id = frame['t'], frame['id']
        if t == 'cancel':
            with self.open_lock:
                handle = self.open.get(req_id)
            if handle is not None:
                handle.cancel()
            return None
        if t == 'ev':
            with self.open_lock:
                handle = self.open.get(req_id)
            if handle is None or not hasattr(handle, 'on_input'):
                return self.error(req_id, 'unknown_request', 'no open request %d takes input' % req_id)
            return handle.on_input(frame['ev'], frame)
        op = frame['op']
        handler = OPS[op]
        if not self.hello and op != 'hello':
            return self.error(req_id, 'hello_required', 'send a hello request first')
        with self.open_lock:
            if req_id in self.open:
                return self.error(req_id, 'duplicate_id', 'request id %d is already open' % req_id)
        try:
            result = handler(self.agent, self, frame)
        except OpError as e:
            return self.finish_error(req_id, e.code, e.message, **e.details)
        except OSError as e:
            e2 = os_error(e)
            return self.finish_error(req_id, e2.code, e2.message, **e2.details)
        except MemoryError:
            return self.finish_error(req_id, 'resource_exhausted', 'out of memory')
        except ValueError as e:  # e.g. an embedded NUL byte in a path, argv or env
            return self.finish_error(req_id, 'bad_request', str(e))
        except Exception as e:
            log('op %s failed: %s' % (op, traceback.format_exc()))
            return self.finish_error(req_id, 'internal', '%s: %s' % (type(e).__name__, e))
        if result is not None:  # None: the op answers later (streams, threads)
            result['t'] = 'res'
            result['id'] = req_id
            return self.finish(req_id, result)
        return None

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with self.open_lock:
            handles = list(self.open.values())
            self.open.clear()
        for h in handles:  # the client is gone: free what its requests hold
            try:
                h.cancel()
            except Exception as e:
                log('cancel on close: %r' % e)
        self.agent.connections.discard(self)


def _frame_id(frame):
    if isinstance(frame, dict):
        i = frame.get('id')
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= 0xFFFFFFFF:
            return i
    return None


def decode_payload(payload):
    """(frame, None) or (None, (id, code, message)) for one msgpack payload."""
    try:
        return msgpack.unpackb(payload, raw=False), None
    except MemoryError:
        return None, (None, 'resource_exhausted', 'out of memory decoding a frame')
    except Exception as e:
        return None, (None, 'bad_frame', 'payload is not valid msgpack: %s' % e)


def validate_client_frame(frame):
    """None when `frame` is a valid client frame, else (id, code, message) for the err frame."""
    if not isinstance(frame, dict):
        return (None, 'bad_frame', 'frame is not a msgpack map')
    t = frame.get('t')
    if t not in ('req', 'ev', 'cancel'):
        return (_frame_id(frame), 'bad_frame', 'field /t: expected one of req, ev, cancel')
    err = check(SCHEMA['frames'][t], frame)
    if err:
        return (_frame_id(frame), 'bad_request', err)
    req_id = frame['id']
    if t == 'ev':
        schema = SCHEMA['clientEvents'].get(frame['ev'])
        if schema is None:
            return (req_id, 'bad_request', 'field /ev: expected one of %s' % ', '.join(SCHEMA['clientEvents']))
        err = check(schema, frame)
        return (req_id, 'bad_request', err) if err else None
    if t == 'req':
        spec = SCHEMA['ops'].get(frame['op'])
        if spec is None or frame['op'] not in OPS:
            return (req_id, 'unknown_op', 'unknown op %r' % frame['op'])
        err = check(spec['args'], frame)
        return (req_id, 'bad_request', err) if err else None
    return None


def run_thread(target, *args, name=None):
    th = threading.Thread(target=target, args=args, name=name, daemon=True)
    th.start()
    return th


# ------------------------------------------------------------------ eval


class EvalOutput:
    """stdout/stderr of one eval: buffered by the eval, sent by the flusher
    thread and finally by the main thread before the response (order kept)."""

    def __init__(self, conn, req_id, wake):
        self.conn = conn
        self.req_id = req_id
        self.wake = wake  # wakes the flusher
        self.segments = []  # [stream, [texts]]
        self.size = 0
        self.buf_lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.drained = threading.Condition(self.buf_lock)
        self.closed = False

    def write(self, stream, text):
        """Buffers text; True when the flusher should be woken."""
        with self.buf_lock:
            if self.closed:
                return False
            first = self.size == 0
            if self.segments and self.segments[-1][0] == stream:
                self.segments[-1][1].append(text)
            else:
                self.segments.append([stream, [text]])
            self.size += len(text)
            wake = first or self.size >= EVAL_FLUSH_BYTES
            if self.size > EVAL_BUFFER_MAX:
                self.wake()  # the flusher must run for us to go on
            while self.size > EVAL_BUFFER_MAX and not self.closed:
                self.drained.wait(0.05)  # back-pressure on a print() loop faster than the socket
        return wake

    def flush(self):
        with self.flush_lock:
            with self.buf_lock:
                segs, self.segments, self.size = self.segments, [], 0
                self.drained.notify_all()
            for stream, parts in segs:
                text = ''.join(parts)
                for i in range(0, len(text), 65536):
                    self.conn.send({'t': 'ev', 'id': self.req_id, 'ev': stream, 'data': text[i:i + 65536]})

    def close(self):
        self.flush()
        with self.buf_lock:
            self.closed = True
            self.drained.notify_all()


class CaptureStream:
    """sys.stdout / sys.stderr replacement: text goes to the eval running now
    (the main thread's, or any thread's while an eval runs), else the console."""

    def __init__(self, agent, name):
        self._agent = agent
        self._name = name
        self._fd = 1 if name == 'stdout' else 2
        self.encoding = getattr(self._fallback, 'encoding', 'utf-8') or 'utf-8'
        self.errors = 'replace'
        self.forked()

    def forked(self):
        """In a process os.fork() made: text not yet written is its own (none,
        or its parent's unfinished line, which the parent writes)."""
        self._forked_lock = threading.RLock()
        self._forked_pending = []
        self._forked_chars = 0

    @property
    def _fallback(self):
        return sys.__stdout__ if self._name == 'stdout' else sys.__stderr__

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError('write() argument must be str, not %s' % type(text).__name__)
        agent = self._agent
        cap = agent.fd_capture
        if cap is not None and cap.copied:
            # A process an eval forked (multiprocessing's workers): fds 1 and 2
            # are the agent's pipes, which the agent reads into that eval. Whole
            # lines per write, as a terminal's Python does: print() writes the
            # text and its newline apart, and lines of concurrent workers (up to
            # PIPE_BUF) must not mix.
            # (An RLock, and the text taken before the write: a signal handler or
            # finaliser that prints while this write blocks runs in this thread.)
            with self._forked_lock:
                self._forked_pending.append(text)
                self._forked_chars += len(text)
                if '\n' in text or self._forked_chars >= FORKED_BUFFER_CHARS:
                    data = ''.join(self._forked_pending)
                    cut = data.rfind('\n') + 1 or len(data)
                    rest = data[cut:]
                    self._forked_pending, self._forked_chars = ([rest] if rest else []), len(rest)
                    _write_all(self._fd, data[:cut].encode('utf-8', 'replace'))
            return len(text)
        sink = agent.output_sink
        if sink is None:
            try:
                return self._fallback.write(text)
            except Exception:
                return len(text)
        if cap is not None:
            # What a subprocess wrote before this print comes first. Looking costs
            # a system call (~1 us, as much as a print), so a print right after
            # another (a loop) does not: a process spawned and waited for in
            # between takes far longer than FD_LOOK_AFTER_NS.
            now = time.monotonic_ns()
            last, cap.last_write = cap.last_write, now
            if now - last > FD_LOOK_AFTER_NS:
                cap.drain()
        if sink.write(self._name, text):
            agent.flush_wakeup.set()
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        cap = self._agent.fd_capture
        if cap is not None and cap.copied:
            # a forked process (its exit flushes): the parent's locks are not ours
            with self._forked_lock:
                data, self._forked_pending, self._forked_chars = ''.join(self._forked_pending), [], 0
                _write_all(self._fd, data.encode('utf-8', 'replace'))
            return
        if self._agent.output_sink is None:
            try:
                self._fallback.flush()
            except Exception:
                pass
        else:
            self._agent.flush_wakeup.set()  # print(..., flush=True): send soon

    def isatty(self):
        return False

    def fileno(self):
        if self._agent.fd_capture is None:
            return self._fallback.fileno()
        return self._fd  # subprocess.run(..., stdout=sys.stdout): captured too

    def writable(self):
        return True

    def readable(self):
        return False

    @property
    def closed(self):
        return False


class Console:
    """The files fds 1 and 2 were when the agent started (the console; the
    host's pipe for the process engine), kept as fds of their own (3 or
    above): the agent's log and output outside evals go there
    (sys.__stdout__ and sys.__stderr__ write there, and faulthandler's
    report of a crash), while fds 1 and 2 are pipes of an FdCapture. Forks
    and branches inherit it as it is."""

    def __init__(self):
        for fd in (0, 1, 2):  # a missing one is /dev/null: the dups below must not take its number
            try:
                os.fstat(fd)
            except OSError:
                os.open(os.devnull, os.O_RDWR)  # (the lowest free number: this one)
        self.fds = {}  # stream name -> fd
        files = []
        for name, target, like in (('stdout', 1, sys.__stdout__), ('stderr', 2, sys.__stderr__)):
            fd = self.fds[name] = fcntl.fcntl(target, fcntl.F_DUPFD_CLOEXEC, 3)  # subprocesses get 1 and 2 only
            try:
                like.flush()
            except Exception:  # noqa: BLE001 - a closed or broken console, or none
                pass
            files.append(open(fd, 'w', buffering=1, closefd=False, errors='backslashreplace',
                              encoding=getattr(like, 'encoding', None) or 'utf-8'))
        sys.__stdout__, sys.__stderr__ = files
        faulthandler.enable(files[1])  # a crash's traceback on the console, not in a pipe that dies with us


class FdCapture:
    """Output written to fds 1 and 2, not through sys.stdout: subprocesses,
    os.system, C code. While it is installed both are pipes of its own; what
    comes through them goes to the eval running now, else to the console.
    One per process: the agent makes one at start, read by a thread of its
    own; a fork or branch releases its parent's (release(): fds 1 and 2 are
    the console again) and opens its own (open()), read by its service
    thread (see forkling_zygote._service). A process an eval forks
    (copied: True) writes its prints to fds 1 and 2, its parent's pipes."""

    def __init__(self, agent):
        self.agent = agent
        self.copied = False  # set in a copy made by os.fork() (an at-fork handler)
        # An RLock: a signal handler or finalizer that prints while this thread drains drains again.
        self.lock = threading.RLock()
        self.streams = {}  # read fd -> stream name
        self.writers = []  # our own fds of the write ends: the pipes never read EOF nor POLLHUP
        # (device, inode) of each pipe -> 1 or 2, kept by release() until open(): what a fork's
        # other fds of them are (forkling_inherit)
        self.keys = {}
        self.decoders = {}  # stream name -> utf-8 decoder, made at its first output
        self.last_write = 0  # time.monotonic_ns() of the last print (CaptureStream.write)
        self.open()
        _thread.start_new_thread(self._loop, ())

    def open(self):
        """Makes the pipes fds 1 and 2 (again, in a fork, after release(): in
        the same objects, made once in the fork server, so a fork copies few
        pages for them; it has just one thread, so no lock can be held)."""
        if self.streams:
            self.release()
        self.keys.clear()
        # drain()'s, under the lock. A new one: one copied by a fork while another thread was in its
        # poll() says so forever.
        self.ready = select.poll()
        try:
            for name, target in (('stdout', 1), ('stderr', 2)):
                r, w = os.pipe()
                self.streams[r] = name
                self.writers.append(w)
                st = os.fstat(r)
                self.keys[(st.st_dev, st.st_ino)] = target
                os.set_blocking(r, False)
                os.dup2(w, target)  # inheritable, as fds 1 and 2 must be
                self.ready.register(r, select.POLLIN)
        except OSError:
            self.release()
            raise
        self.copied = False  # (a fork's own pipes now, whichever way it was forked)

    def _loop(self):
        poller = select.poll()
        for r in self.streams:
            poller.register(r, select.POLLIN)
        while True:
            try:
                events = poller.poll()
            except OSError:
                return
            if any(ev & select.POLLNVAL for _, ev in events):
                log('eval output: a pipe of fds 1 and 2 was closed under the agent; not read any more')
                return
            self.drain_logged()

    def drain_logged(self):
        """drain(), for a reader: an error (out of memory) is logged, and the reader goes on."""
        try:
            self.drain()
        except Exception as e:  # noqa: BLE001 - MemoryError, or a broken sink
            log('eval output: %s' % e)
            time.sleep(0.05)

    def drain(self):
        """Delivers what the pipes hold now, each piece where output goes now:
        the reader does when they have some, a print() first (what a
        subprocess wrote before it comes before it), an eval at its end (what
        its subprocesses wrote is its output). Under the lock, so a piece the
        reader has taken is delivered before anyone goes on; at most what was
        queued when it began, so a process that keeps writing cannot keep
        it here. Console output is written after the lock is let go."""
        agent = self.agent
        console = []
        with self.lock:
            if not self.ready.poll(0):
                return
            for r, name in self.streams.items():
                try:
                    left = struct.unpack('i', fcntl.ioctl(r, termios.FIONREAD, b'\0\0\0\0'))[0]
                except OSError:
                    continue
                while left > 0:
                    try:
                        data = os.read(r, min(left, OUTPUT_READ))
                    except OSError:  # empty (EAGAIN)
                        break
                    if not data:
                        break
                    left -= len(data)
                    sink = agent.output_sink
                    if sink is None:
                        console.append((name, data))
                        continue
                    decoder = self.decoders.get(name)
                    if decoder is None:
                        decoder = self.decoders[name] = codecs.getincrementaldecoder('utf-8')('replace')
                    text = decoder.decode(data)
                    if text and sink.write(name, text):
                        agent.flush_wakeup.set()
        for name, data in console:
            _write_all(agent.console.fds[name], data)

    def finish(self, sink):
        """At an eval's end, under the lock: the rest of a character split at the end goes to it too."""
        for name, decoder in self.decoders.items():
            tail = decoder.decode(b'', True)
            if tail:
                sink.write(name, tail)
        self.decoders = {}

    def release(self):
        """Fds 1 and 2 are the console again; the pipes are closed here (in a
        fork's copy: the parent's go on in the parent). open() makes new ones;
        until then `keys` still says what the released pipes were."""
        for name, target in (('stdout', 1), ('stderr', 2)):
            try:
                os.dup2(self.agent.console.fds[name], target)
            except OSError:
                pass
        for fd in list(self.streams) + self.writers:
            try:
                os.close(fd)
            except OSError:
                pass
        self.ready = select.poll()
        self.copied = False
        self.streams.clear()
        self.writers.clear()
        self.decoders.clear()

    def own_fds(self):
        return set(self.streams) | set(self.writers)


# os.register_at_fork as it is before the process engine's hook wraps it for the warm-up
# (the fork server need not run the agent's own handler in every fork: each opens its own pipes).
_register_at_fork = os.register_at_fork


def _write_all(fd, data):
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # the console is gone: drop it


class EvalJob:
    def __init__(self, agent, conn, frame):
        self.agent = agent
        self.conn = conn
        self.id = frame['id']
        self.code = frame['code']
        self.context = frame.get('context') or 'default'
        t = frame.get('timeoutMs')
        self.deadline = time.monotonic() + t / 1000.0 if t else None
        self.state = 'queued'  # queued -> running -> done; changed under agent.eval_lock
        self.cancelled = False
        self.timed_out = False
        self.interrupts = 0
        self.last_interrupt = 0.0

    def cancel(self):
        self.agent.stop_eval(self, cancelled=True)


def _to_wire(v, budget, depth=0):
    """v as msgpack-able data (numbers, str, bytes, bool, None, lists, str-keyed
    maps), or raise ValueError when it is not representable."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 100:
        raise ValueError('too large')
    if isinstance(v, (str, bytes)):
        budget[1] -= len(v)  # characters or bytes: keeps the result well inside MAX_FRAME
        if budget[1] < 0:
            raise ValueError('too large')
        return v
    if v is None or isinstance(v, (bool, float)):
        return v
    if isinstance(v, int):
        if -(1 << 63) <= v < (1 << 64):
            return int(v)
        raise ValueError('integer out of range')
    if isinstance(v, (list, tuple)):
        return [_to_wire(x, budget, depth + 1) for x in v]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValueError('non-string key')
            out[k] = _to_wire(x, budget, depth + 1)
        return out
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    mod = type(v).__module__ or ''
    if mod == 'numpy' or mod.startswith('numpy.'):
        # numpy scalars and arrays as plain numbers / nested lists (the type field still says numpy)
        size = getattr(v, 'size', 1)
        if isinstance(size, int) and size <= budget[0] and hasattr(v, 'tolist'):
            return _to_wire(v.tolist(), budget, depth + 1)
    raise ValueError('not plain data')


def _type_name(v):
    t = type(v)
    mod = t.__module__
    return t.__qualname__ if mod == 'builtins' else '%s.%s' % (mod, t.__qualname__)


def _safe_repr(v):
    try:
        r = repr(v)
    except BaseException as e:  # noqa: BLE001 - user __repr__ may raise anything
        r = '<repr failed: %s>' % type(e).__name__
    if not isinstance(r, str):
        r = '<repr returned %s>' % type(r).__name__
    if len(r) > REPR_MAX:
        r = r[:REPR_MAX] + '...[%d characters truncated]' % (len(r) - REPR_MAX)
    return r


def _safe_str(e):
    try:
        return str(e)
    except BaseException as x:  # noqa: BLE001
        return '<str failed: %s>' % type(x).__name__


def _clip(text, limit):
    return text if len(text) <= limit else text[:limit] + '...[%d characters truncated]' % (len(text) - limit)


def _format_exception(e):
    if isinstance(e, SyntaxError):
        return ''.join(traceback.format_exception_only(type(e), e))
    te = traceback.TracebackException(type(e), e, e.__traceback__)
    # drop the agent's own frames (_execute, the SIGINT handler): show the user's code only
    te.stack = traceback.StackSummary.from_list([fs for fs in te.stack if fs.filename != __file__])
    return ''.join(te.format())


def new_namespace():
    return {'__name__': '__main__', '__builtins__': __builtins__}


# ------------------------------------------------------------------ processes


class Proc:
    """One process started by exec; outlives its request when background."""

    def __init__(self, agent, proc_id, popen, argv, background, conn, req_id, deadline):
        self.agent = agent
        self.id = proc_id
        self.popen = popen
        self.pid = popen.pid
        self.argv = argv
        self.background = background
        self.conn = conn  # None once detached
        self.req_id = req_id
        self.deadline = deadline
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.tails = {'stdout': bytearray(), 'stderr': bytearray()}
        self.exit_code = None
        self.signal = None
        self.timed_out = False
        self.cancelled = False
        self.done = threading.Event()
        self.stdin_q = None
        self.lock = threading.Lock()

    def info(self):
        return {'procId': self.id, 'pid': self.pid, 'exitCode': self.exit_code, 'signal': self.signal}

    def kill_group(self, sig=signal.SIGKILL):
        if self.done.is_set():
            return False
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            try:
                os.kill(self.pid, sig)
                return True
            except ProcessLookupError:
                return False

    # request handle protocol (the exec request stays open until exit)
    def cancel(self):
        with self.lock:
            conn, self.conn = self.conn, None
        if self.background:  # a background process outlives its request and connection
            if conn is not None:
                conn.finish_error(self.req_id, 'cancelled', 'detached; process %s keeps running' % self.id)
            return
        self.cancelled = True
        self.kill_group()
        if conn is not None:
            conn.finish_error(self.req_id, 'cancelled', 'cancelled; process group killed')

    def on_input(self, ev, frame):
        if self.stdin_q is None:
            return self._send_err('bad_request', 'this exec was not started with stdinStream')
        self.stdin_q.put(frame['data'] if ev == 'data' else None)
        return None

    def _send_err(self, code, msg):
        conn = self.conn
        if conn is not None:
            conn.error(self.req_id, code, msg)

    def send_event(self, ev, data):
        conn = self.conn
        if conn is not None and not conn.send({'t': 'ev', 'id': self.req_id, 'ev': ev, 'data': data}):
            with self.lock:
                if self.conn is conn:
                    self.conn = None
            if not self.background:
                self.cancelled = True
                self.kill_group()

    def stdin_writer(self, fd):
        try:
            while True:
                data = self.stdin_q.get()
                if data is None:
                    break
                view = memoryview(data)
                while view:
                    k = os.write(fd, view)
                    view = view[k:]
        except OSError:
            pass  # EPIPE: the process closed stdin; later data is dropped
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
            # drain so producers never block on a dead writer
            self.stdin_q = _Sink()

    def io_loop(self):
        """Reads stdout/stderr until both close, enforces the timeout, reaps."""
        sel = selectors.DefaultSelector()
        fds = {}
        for name, f in (('stdout', self.popen.stdout), ('stderr', self.popen.stderr)):
            fd = f.fileno()
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, name)
            fds[fd] = f
        exited_at = None
        try:
            while fds:
                timeout = 0.2
                if self.deadline is not None:
                    left = self.deadline - time.monotonic()
                    if left <= 0 and not self.timed_out:
                        self.timed_out = True
                        self.kill_group()
                    timeout = max(0.0, min(timeout, left)) if not self.timed_out else 0.2
                for key, _ in sel.select(timeout):
                    fd, name = key.fd, key.data
                    try:
                        data = os.read(fd, OUTPUT_READ)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b''
                    if not data:
                        sel.unregister(fd)
                        fds.pop(fd).close()
                        continue
                    tail = self.tails[name]
                    tail += data
                    if len(tail) > TAIL_KEEP:
                        del tail[:len(tail) - TAIL_KEEP]
                    self.send_event(name, data)
                if fds and self.popen.poll() is not None:
                    # a grandchild may hold the pipes open: give it a moment, then stop waiting
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 0.2:
                        break
        finally:
            for f in fds.values():
                f.close()
            sel.close()
        rc = self.popen.wait()
        if rc >= 0:
            self.exit_code = rc
        else:
            try:
                self.signal = signal.Signals(-rc).name
            except ValueError:
                self.signal = 'SIG%d' % -rc
        self.done.set()
        self.agent.proc_exited(self)
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None and not self.cancelled:
            res = self.info()
            res.update(t='res', id=self.req_id, timedOut=self.timed_out,
                       durationMs=(time.monotonic() - self.t0) * 1000.0)
            conn.finish(self.req_id, res)


class _Sink:
    def put(self, _):
        pass


class WaitHandle:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


# ------------------------------------------------------------------ the agent


class Agent:
    def __init__(self, config):
        self.config = config
        self.t0 = time.monotonic()
        self.sandbox_id = None
        self.contexts = {'default': new_namespace()}
        self.frames = 0  # frames taken from clients: what "idle" is measured by (forkling_memfile)
        # A process-engine sandbox's service thread sleeps with no timeout while idle
        # (forkling_zygote._service); the next client frame wakes it through this eventfd.
        self.service_asleep = False
        self.service_wake_fd = None
        self.connections = set()
        self.listeners = []
        # Connection threads: one that finished waits here for the next
        # connection (see _serve).
        self.conn_handoff = queue.SimpleQueue()
        self.conn_parked = 0
        self.conn_lock = threading.Lock()
        self.procs = {}  # procId -> Proc
        self.proc_seq = 0
        self.procs_lock = threading.Lock()
        self.main_ident = threading.get_ident()
        # eval machinery (main thread)
        self.eval_queue = queue.SimpleQueue()
        self.eval_lock = threading.Lock()
        self.eval_waiting = []  # jobs with a deadline, queued or running
        self.running = None  # the EvalJob executing in the main thread
        self.interrupt_for = None
        self.output_sink = None
        self.flush_wakeup = threading.Event()
        self.watch_wakeup = threading.Event()
        self.cell_seq = 0
        self.cells = []
        self.stopping = False
        self.random_fd = None
        self.capture = (sys.stdout, sys.stderr)  # CaptureStreams once install_io() ran
        self.console = None  # Console, once install_io() ran
        self.fd_capture = None  # FdCapture, once install_io() ran (in a fork: once it is set up)

    # -- start
    def install_io(self):
        self.capture = (CaptureStream(self, 'stdout'), CaptureStream(self, 'stderr'))
        sys.stdout, sys.stderr = self.capture
        try:
            self.console = Console()
            self.fd_capture = FdCapture(self)
        except OSError as e:  # out of fds
            log('output of subprocesses in evals is not captured: %s' % e)
        _register_at_fork(after_in_child=self._forked)
        try:
            sys.stdin = open(os.devnull)  # input() in an eval gets EOF, never blocks on the console
        except OSError:
            pass
        signal.signal(signal.SIGINT, self._on_sigint)
        run_thread(self._flusher, name='eval-flusher')
        run_thread(self._watchdog, name='eval-watchdog')

    def _forked(self):
        cap = self.fd_capture
        if cap is not None:
            cap.copied = True  # its reader is the parent's thread; the process engine makes a new one
        for stream in self.capture:
            stream.forked()

    def listen_unix(self, path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(128)
        self.listeners.append(s)
        run_thread(self._accept_loop, s, name='accept-unix')
        return s

    def listen_vsock(self, port):
        s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        s.bind((socket.VMADDR_CID_ANY, port))
        s.listen(128)
        self.listeners.append(s)
        run_thread(self._accept_loop, s, name='accept-vsock')
        return s

    def _accept_loop(self, lsock):
        while not self.stopping:
            try:
                sock, peer = lsock.accept()
            except OSError as e:
                if self.stopping:
                    return
                if e.errno in (errno.EBADF, errno.EINVAL):
                    log('listener failed: %s' % e)
                    return
                time.sleep(0.01)  # ECONNABORTED, EMFILE, ...: keep accepting
                continue
            conn = None
            try:
                conn = Connection(self, sock, peer)
                self.connections.add(conn)
                self._serve(conn)
            except Exception as e:  # no thread (pids limit), no memory: this connection only, then accept on
                if conn is not None:
                    self.connections.discard(conn)
                sock.close()
                log('connection refused: %s: %s' % (type(e).__name__, e))
                time.sleep(0.05)

    def _serve(self, conn):
        """Runs a connection on the parked connection thread if there is one,
        else on a new thread. A template parks one (its rehearsed connections
        ended), so a forked VM's first connection starts no thread: no new
        kernel task, kernel stack or Python thread state to copy into the
        child's memory."""
        with self.conn_lock:
            if self.conn_parked:
                self.conn_parked -= 1
                self.conn_handoff.put(conn)
                return
        run_thread(self._conn_thread, conn, name='conn')

    def _conn_thread(self, conn):
        while True:
            conn.run()
            conn = None
            with self.conn_lock:
                if self.conn_parked >= 1 or self.stopping:
                    return
                self.conn_parked += 1
            conn = self.conn_handoff.get()

    # -- eval, main thread
    def eval_loop(self):
        while not self.stopping:
            try:
                job = self.eval_queue.get()
                if job is None:
                    break
                self.run_eval(job)
            except KeyboardInterrupt:
                continue  # a late interrupt (the handler normally drops those)
            except MemoryError:
                continue
            except Exception:
                log('eval loop: %s' % traceback.format_exc())

    def _on_sigint(self, signum, frame):
        job = self.interrupt_for
        if job is not None and job is self.running:
            self.interrupt_for = None
            raise KeyboardInterrupt

    def _interrupt(self, job):
        # caller holds eval_lock
        if job.state == 'running' and self.running is job:
            job.interrupts += 1
            job.last_interrupt = time.monotonic()
            self.interrupt_for = job
            signal.pthread_kill(self.main_ident, signal.SIGINT)

    def stop_eval(self, job, cancelled=False, timed_out=False):
        """Cancel or time out an eval: drop it if queued, interrupt it if running."""
        with self.eval_lock:
            if job.state == 'done':
                return
            job.cancelled = job.cancelled or cancelled
            job.timed_out = job.timed_out or timed_out
            if job.state == 'queued':
                job.state = 'done'
                queued = True
            else:
                queued = False
                self._interrupt(job)
        if queued:
            if job.cancelled:
                job.conn.finish_error(job.id, 'cancelled', 'eval cancelled before it started')
            else:
                job.conn.finish(job.id, {
                    't': 'res', 'id': job.id, 'repr': '', 'type': 'TimeoutError', 'timedOut': True, 'durationMs': 0.0,
                    'exception': {'type': 'TimeoutError', 'message': 'the eval did not start before its timeout '
                                  '(another eval was running)', 'traceback': ''}})

    def submit_eval(self, job):
        if job.deadline is not None:
            with self.eval_lock:
                self.eval_waiting.append(job)
            self.watch_wakeup.set()
        self.eval_queue.put(job)

    def _watchdog(self):
        while True:
            now = time.monotonic()
            wait = None
            expired = []
            with self.eval_lock:
                keep = []
                for job in self.eval_waiting:
                    if job.state == 'done':
                        continue
                    keep.append(job)
                    if job.timed_out:  # interrupt sent; repeat if the code swallowed it
                        if job.state == 'running' and self.interrupt_for is None and now - job.last_interrupt > 1.0:
                            self._interrupt(job)
                        wait = 0.25 if wait is None else min(wait, 0.25)
                    elif now >= job.deadline:
                        expired.append(job)
                    else:
                        left = job.deadline - now
                        wait = left if wait is None else min(wait, left)
                self.eval_waiting = keep
            for job in expired:
                self.stop_eval(job, timed_out=True)
            if expired:
                continue
            self.watch_wakeup.wait(wait)
            self.watch_wakeup.clear()

    def _flusher(self):
        while True:
            self.flush_wakeup.wait()
            time.sleep(EVAL_FLUSH_S)  # gather a little more output per frame
            self.flush_wakeup.clear()
            sink = self.output_sink
            if sink is not None:
                sink.flush()

    def run_eval(self, job):
        with self.eval_lock:
            if job.state != 'queued':
                return  # cancelled or timed out while queued (already answered)
            job.state = 'running'
        ns = self.contexts.get(job.context)
        if ns is None:
            ns = self.contexts[job.context] = new_namespace()
        cap = self.fd_capture
        sink = EvalOutput(job.conn, job.id, self.flush_wakeup.set)
        self.output_sink = sink
        self.cell_seq += 1
        filename = '<cell-%d>' % self.cell_seq
        t0 = time.perf_counter()
        value = exc = None
        try:
            self.running = job  # interrupts may land from here on
            value = self._execute(job.code, ns, filename)
            self.running = None  # from here on, a late SIGINT is ignored
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            self.running = None
            exc = e
        self.running = None
        duration = (time.perf_counter() - t0) * 1000.0
        with self.eval_lock:
            job.state = 'done'
            self.interrupt_for = None
        if job.deadline is not None:
            # The watchdog drops it now and waits with no timeout, rather than waking at its deadline
            # (a template's warm-up limit: in every child of it, later, and a doze refused till then).
            self.watch_wakeup.set()
        if cap is not None and not cap.copied:  # (a process the eval forked that fell off its end: not its to take)
            try:
                with cap.lock:  # what the eval's subprocesses wrote before it ended is its output
                    cap.drain()
                    cap.finish(sink)
                    self.output_sink = None
            except BaseException as e:  # noqa: BLE001 - out of memory, an interrupt: the eval still answers
                log('eval output: %r' % e)
        self.output_sink = None
        sink.close()
        if signal.getsignal(signal.SIGINT) != self._on_sigint:
            signal.signal(signal.SIGINT, self._on_sigint)  # the eval replaced it; timeouts need it
        if sys.stdout is not self.capture[0] or sys.stderr is not self.capture[1]:
            sys.stdout, sys.stderr = self.capture  # the eval left them redirected; later evals need capture
        res = {'t': 'res', 'id': job.id, 'timedOut': job.timed_out, 'durationMs': duration}
        try:
            if exc is not None:
                if isinstance(exc, MemoryError):
                    traceback.clear_frames(exc.__traceback__)  # free what the failed code held first
                res['exception'] = {'type': _type_name(exc), 'message': _clip(_safe_str(exc), REPR_MAX),
                                    'traceback': _clip(_format_exception(exc), TRACEBACK_MAX)}
                res['repr'] = _safe_repr(exc)
                res['type'] = _type_name(exc)
            else:
                res['repr'] = _safe_repr(value)
                res['type'] = _type_name(value)
                try:
                    res['value'] = _to_wire(value, [VALUE_MAX_ITEMS, VALUE_MAX_BYTES])
                except Exception:  # noqa: BLE001 - not plain data, or user code (tolist, items) failed
                    pass
        except BaseException as e:  # noqa: BLE001 - out of memory, or a hostile __str__/__repr__
            name = 'MemoryError' if isinstance(e, MemoryError) else type(e).__name__
            res = {'t': 'res', 'id': job.id, 'timedOut': job.timed_out, 'durationMs': duration,
                   'repr': '', 'type': name,
                   'exception': {'type': name, 'message': 'the result could not be described', 'traceback': ''}}
        finally:
            exc = value = None
        if job.cancelled:
            job.conn.finish_error(job.id, 'cancelled', 'eval cancelled (interrupted)')
        else:
            job.conn.finish(job.id, res)

    def _execute(self, code, ns, filename):
        tree = ast.parse(code, filename, 'exec')
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        # keep recent cells' source for tracebacks and inspect
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self.cells.append(filename)
        if len(self.cells) > 200:
            linecache.cache.pop(self.cells.pop(0), None)
        if tree.body:
            exec(compile(tree, filename, 'exec'), ns)
        if last is not None:
            return eval(compile(last, filename, 'eval'), ns)
        return None

    # -- processes
    def new_proc_id(self):
        with self.procs_lock:
            self.proc_seq += 1
            return 'p%d' % self.proc_seq

    def get_proc(self, proc_id):
        p = self.procs.get(proc_id)
        if p is None:
            raise OpError('no_such_process', 'no process %r (see proc.list)' % proc_id, procId=proc_id)
        return p

    def proc_exited(self, proc):
        with self.procs_lock:
            if not proc.background:
                self.procs.pop(proc.id, None)
            finished = [p for p in self.procs.values() if p.done.is_set()]
            for p in finished[:-256]:  # keep the last 256 finished background processes
                self.procs.pop(p.id, None)

    def idle(self):
        """No eval runs and no client request is open."""
        return self.running is None and not any(c.open for c in list(self.connections))

    def tracked_pids(self):
        with self.procs_lock:
            return {p.pid for p in self.procs.values() if p.exit_code is None and p.signal is None}

    # -- shutdown
    def shutdown(self, reboot=False):
        self.stopping = True
        for s in self.listeners:
            try:
                s.close()
            except OSError:
                pass
        for p in list(self.procs.values()):
            p.kill_group()
        if IS_PID1:
            pid1_poweroff(reboot)
        else:
            try:
                sys.__stdout__.flush()
            except Exception:
                pass
            os._exit(0)


_POOL_FILL = []  # filler blocks of a template (a fork server, a VM template): never freed


def fill_pool_holes():
    """In a template (the process engine's fork server; a VM template, through
    an eval, see host/engine/kvm/template.ts), last before gc.freeze(): takes
    every free block of pymalloc's partly used pools, so that what a child
    allocates comes from pools of its own, packed, rather than from the
    holes scattered through the template's pools: each hole a child filled
    cost it a copy of that page (4 KiB for a 16-512 byte object). The sizes
    and counts are CPython's own (sys._debugmallocstats, on stderr); without
    pymalloc, or in a format not understood, this does nothing."""
    avail = _pool_holes()
    keep = [None] * sum(avail.values())
    i = 0
    for size, n in avail.items():
        for _ in range(n):
            # a block of `size`: object() is 16 bytes, a float 24, bytes(k) 33 + k
            keep[i] = object() if size <= 16 else float(i) if size <= 32 else bytes(size - 33)
            i += 1
    _POOL_FILL.append(keep)


def _pool_holes():
    """{block size: free blocks in used pools} from sys._debugmallocstats()."""
    if not hasattr(sys, '_debugmallocstats'):
        return {}
    r, w = os.pipe()
    saved = os.dup(2)
    try:
        os.dup2(w, 2)
        sys._debugmallocstats()  # one screenful: fits in the pipe
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(w)
    out = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        out.append(b)
    os.close(r)
    avail = {}
    # "class   size   num pools   blocks in use  avail blocks"
    for line in b''.join(out).decode('ascii', 'replace').splitlines():
        f = line.split()
        if len(f) == 5 and all(x.isdigit() for x in f) and 16 <= int(f[1]) <= 512 and int(f[1]) % 8 == 0:
            avail[int(f[1])] = int(f[4])
    return avail


# ------------------------------------------------------------------ operations


def op_hello(agent, conn, f):
    common = [v for v in f['versions'] if v in PROTOCOL_VERSIONS]
    if not common:
        raise OpError('unsupported_version', 'no common protocol version: client offers %s, agent speaks %s'
                      % (f['versions'], list(PROTOCOL_VERSIONS)), supported=list(PROTOCOL_VERSIONS))
    conn.hello = True
    return {'version': max(common), 'agent': AGENT_VERSION, 'python': sys.version.split()[0], 'pid': os.getpid(),
            'sandboxId': agent.sandbox_id, 'limits': {'maxFrame': MAX_FRAME, 'maxChunk': MAX_CHUNK},
            'ops': sorted(OPS)}


def op_ping(agent, conn, f):
    return {'time': time.time()}


def _meminfo():
    rss = 0
    try:
        with open('/proc/self/statm') as fh:
            rss = int(fh.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError, IndexError):
        pass
    total = avail = None
    try:
        with open('/proc/meminfo') as fh:
            for line in fh:
                if line.startswith('MemTotal:'):
                    total = int(line.split()[1]) * 1024
                elif line.startswith('MemAvailable:'):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return {'rss': rss, 'total': total, 'available': avail}


# x86-64 system calls a thread may sleep in for as long as it likes: only
# another task or input from outside (the host, over vsock) ends the wait.
# Argument index and how to read it for those that can carry a timeout.
_NR_FUTEX = 202
_FUTEX_WAITS = {0, 6, 9, 11, 13}  # WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2
_WAITS_UNTIMED = {0, 1, 19, 20, 34, 43, 44, 45, 46, 47, 61, 130, 247, 288}  # read write readv writev pause accept sendto recvfrom sendmsg recvmsg wait4 rt_sigsuspend waitid accept4
_WAITS_TIMEOUT_INT = {7: 2, 232: 3, 281: 3}  # poll, epoll_wait, epoll_pwait: an int, < 0 for none
_SYSCALL_NAMES = {7: 'poll', 23: 'select', 35: 'nanosleep', 202: 'futex', 230: 'clock_nanosleep', 232: 'epoll_wait',
                  270: 'pselect6', 271: 'ppoll', 281: 'epoll_pwait', 441: 'epoll_pwait2', 128: 'rt_sigtimedwait'}
_WAITS_TIMEOUT_PTR = {23: 4, 128: 2, 270: 4, 271: 2, 441: 3}  # select, rt_sigtimedwait, pselect6, ppoll, epoll_pwait2: NULL for none


def _waits_untimed(line):
    """Whether a /proc/<pid>/task/<tid>/syscall line is a wait with no timeout."""
    parts = line.split()
    if len(parts) < 7 or parts[0] in ('running', '-1'):
        return False
    try:
        nr, args = int(parts[0]), [int(a, 16) for a in parts[1:7]]
    except ValueError:
        return False
    if nr in _WAITS_UNTIMED:
        return True
    if nr == _NR_FUTEX:
        return (args[1] & 0x7f) in _FUTEX_WAITS and args[3] == 0
    if nr in _WAITS_TIMEOUT_INT:
        return (args[_WAITS_TIMEOUT_INT[nr]] & 0xffffffff) >= 0x80000000
    if nr in _WAITS_TIMEOUT_PTR:
        return args[_WAITS_TIMEOUT_PTR[nr]] == 0
    return False


_X86_64 = os.uname().machine == 'x86_64'
_RUNNING_LOOKS = 20


def _child_runs():
    """Names a process the agent started (or adopted) that lives. A thread
    that ends hands its children to another thread of the agent, so a thread
    gone (or a child moved) between the listing and the read is looked at
    again, a few times, before the answer gets vague."""
    for _ in range(3):
        try:
            tids = os.listdir('/proc/self/task')
        except OSError:
            break
        for tid in tids:
            try:
                pids = _read('/proc/self/task/%s/children' % tid).split()
            except OSError:
                continue
            for pid in pids:
                try:
                    return 'process %s (%s) runs' % (pid, _read('/proc/%s/comm' % pid).strip())
                except OSError:
                    return 'process %s runs' % pid
    return 'a process besides the agent runs'


def _read(path):
    with open(path) as fh:
        return fh.read()


def quiet_check():
    """What in this sandbox would run if no input came: None when nothing
    would (no process lives besides the agent, every thread of the agent
    waits with no timeout, no timer is armed), else a short reason. Reads
    little of /proc: each entry it lists is a kernel object made in the guest,
    a page more in every child that asks (processes are told by waitid)."""
    if not IS_PID1:
        return 'the agent is not PID 1: the processes about it are not its own'
    if not _X86_64:
        return 'the agent reads system calls of x86-64 only'
    # Every process of the machine descends from PID 1 (orphans are reparented to it): none lives
    # when it has no child.
    try:
        z = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        pass
    else:
        return 'process %d exited and is not reaped yet' % z.si_pid if z is not None else _child_runs()
    me = threading.get_native_id()
    for tid in os.listdir('/proc/self/task'):
        if int(tid) in (me, REAPER_TID):
            # (this one goes back to waiting for the host; the reaper ticks while a request is in
            # flight, and sleeps with no timeout once none is and no zombie is left: reaper())
            continue
        try:
            line = _read('/proc/self/task/%s/syscall' % tid)
            # A thread on its way to a wait (one that just sent an answer or output, or is
            # ending) is seen running: looked at again for a few ms before it counts as busy.
            for _ in range(_RUNNING_LOOKS):
                if not line.startswith('running'):
                    break
                time.sleep(0.001)
                line = _read('/proc/self/task/%s/syscall' % tid)
        except OSError:
            continue  # (it ended)
        if not _waits_untimed(line):
            try:
                comm = _read('/proc/self/task/%s/comm' % tid).strip()
            except OSError:
                comm = '?'
            nr = line.split(' ', 1)[0]
            doing = 'runs' if not nr.isdigit() else 'waits in %s with a timeout' % _SYSCALL_NAMES.get(int(nr), 'system call ' + nr)
            return 'thread %s (%s) %s' % (tid, comm, doing)
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return 'an alarm (signal.alarm or setitimer) is set'
    try:
        if 'ID:' in _read('/proc/self/timers'):
            return 'a POSIX timer exists'
    except OSError:
        pass
    for fd in os.listdir('/proc/self/fd'):
        try:
            if os.readlink('/proc/self/fd/%s' % fd) == 'anon_inode:[timerfd]' and \
                    'it_value: (0, 0)' not in _read('/proc/self/fdinfo/%s' % fd):
                return 'a timerfd is armed'
        except OSError:
            continue
    return None


_malloc_trim = None


def _trim_heap():
    """Gives the free pages of the C heap back to the kernel (glibc's
    malloc_trim): what the sandbox freed then reads as zeros (the kernel
    zeroes what it frees), which the host gives back or packs in a few bytes
    while the VM dozes, instead of keeping the garbage."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = _libc().malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False  # (not glibc)
    if _malloc_trim:
        _malloc_trim(0)


def op_quiet(agent, conn, f):
    busy = quiet_check()
    if busy is None:
        _trim_heap()  # (the host dozes it now)
    return {'quiet': busy is None, 'busy': busy}


def op_info(agent, conn, f):
    mods = sorted(k for k in list(sys.modules) if isinstance(k, str))
    r = {'agent': AGENT_VERSION, 'version': PROTOCOL_VERSIONS[-1], 'python': sys.version.split()[0],
         'pid': os.getpid(), 'pid1': IS_PID1, 'uptime': time.monotonic() - agent.t0, 'sandboxId': agent.sandbox_id,
         'hostname': socket.gethostname(), 'moduleCount': len(mods), 'memory': _meminfo(),
         'contexts': sorted(agent.contexts), 'procs': len(agent.procs), 'connections': len(agent.connections)}
    if f.get('modules'):
        r['modules'] = mods
    return r


def op_eval(agent, conn, f):
    job = EvalJob(agent, conn, f)
    conn.register(job.id, job)
    agent.submit_eval(job)
    return None


def op_context_list(agent, conn, f):
    return {'contexts': sorted(agent.contexts)}


def op_context_delete(agent, conn, f):
    name = f['context']
    deleted = agent.contexts.pop(name, None) is not None
    if name == 'default':
        agent.contexts['default'] = new_namespace()  # the default always exists: deleting empties it
    return {'deleted': deleted}


def op_exec(agent, conn, f):
    argv, shell = f.get('argv'), f.get('shell')
    if (argv is None) == (shell is None):
        raise OpError('bad_request', 'field /argv: give exactly one of argv (a list) or shell (a string)')
    cmd = list(argv) if argv is not None else ['/bin/sh', '-c', shell]
    env = {} if f.get('clearEnv') else dict(os.environ)
    env.update(f.get('env') or {})
    stream_in = bool(f.get('stdinStream'))
    stdin_data = f.get('stdin')
    want_stdin = stream_in or stdin_data is not None
    try:
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=f.get('cwd'), env=env,
                                 start_new_session=True, close_fds=True, bufsize=0)
    except OSError as e:
        if e.errno == errno.ENOENT and e.filename == cmd[0]:
            raise OpError('not_found', 'command not found: %s' % cmd[0], errno='ENOENT', path=cmd[0])
        raise
    t = f.get('timeoutMs')
    deadline = time.monotonic() + t / 1000.0 if t else None
    proc = Proc(agent, agent.new_proc_id(), popen, cmd, bool(f.get('background')), conn, f['id'], deadline)
    with agent.procs_lock:
        agent.procs[proc.id] = proc
    if want_stdin:
        proc.stdin_q = queue.Queue(maxsize=64)  # back-pressure: at most 64 chunks wait for the process
        if stdin_data:
            proc.stdin_q.put(stdin_data)
        if not stream_in:
            proc.stdin_q.put(None)
        fd = os.dup(popen.stdin.fileno())
        popen.stdin.close()
        run_thread(proc.stdin_writer, fd, name='stdin')
    conn.register(proc.req_id, proc)
    conn.send({'t': 'ev', 'id': proc.req_id, 'ev': 'started', 'procId': proc.id, 'pid': proc.pid})
    run_thread(proc.io_loop, name='proc-io')
    return None


def op_proc_list(agent, conn, f):
    with agent.procs_lock:
        procs = list(agent.procs.values())
    out = []
    for p in procs:
        d = p.info()
        d.update(argv=list(p.argv), running=not p.done.is_set(), background=p.background, startedAt=p.started_at)
        out.append(d)
    return {'procs': out}


def op_proc_wait(agent, conn, f):
    proc = agent.get_proc(f['procId'])
    t = f.get('timeoutMs')
    req_id = f['id']
    handle = WaitHandle()
    conn.register(req_id, handle)

    def wait():
        deadline = time.monotonic() + t / 1000.0 if t else None  # (0, as absent: no limit)
        while not proc.done.is_set() and not handle.cancelled.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            proc.done.wait(0.2 if left is None else min(0.2, left))
        if handle.cancelled.is_set():
            return conn.finish_error(req_id, 'cancelled', 'wait cancelled')
        r = proc.info()
        r.update(t='res', id=req_id, running=not proc.done.is_set(), stdoutTail=bytes(proc.tails['stdout']),
                 stderrTail=bytes(proc.tails['stderr']))
        conn.finish(req_id, r)

    run_thread(wait, name='proc-wait')
    return None


def op_proc_write(agent, conn, f):
    proc = agent.get_proc(f['procId'])
    if proc.stdin_q is None:
        raise OpError('bad_request', 'process %s was not started with stdin or stdinStream' % proc.id)
    if isinstance(proc.stdin_q, _Sink):
        raise OpError('io_error', 'stdin of process %s is closed' % proc.id, errno='EPIPE')
    proc.stdin_q.put(f['data'])
    return {'written': len(f['data'])}


def op_proc_close_stdin(agent, conn, f):
    proc = agent.get_proc(f['procId'])
    if proc.stdin_q is not None:
        proc.stdin_q.put(None)
    return {'done': True}


def _signal_number(s):
    if isinstance(s, int):
        return s
    name = s.upper()
    if not name.startswith('SIG'):
        name = 'SIG' + name
    try:
        return signal.Signals[name].value
    except KeyError:
        raise OpError('bad_request', 'field /signal: unknown signal %r' % s)


def op_proc_signal(agent, conn, f):
    proc = agent.get_proc(f['procId'])
    sig = _signal_number(f['signal'])
    if proc.done.is_set():
        return {'done': False}
    try:
        if f.get('group', True):
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except ProcessLookupError:
        return {'done': False}
    return {'done': True}


def op_proc_kill(agent, conn, f):
    return {'done': agent.get_proc(f['procId']).kill_group()}


_IFMT = {stat.S_IFREG: 'file', stat.S_IFDIR: 'dir', stat.S_IFLNK: 'symlink'}


def _stat_fields(st):
    return {'type': _IFMT.get(stat.S_IFMT(st.st_mode), 'other'), 'size': st.st_size,
            'mode': stat.S_IMODE(st.st_mode), 'mtime': st.st_mtime}


class FileRead:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def op_files_read(agent, conn, f):
    path, req_id = f['path'], f['id']
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OpError('is_a_directory', '%s: is a directory' % path, errno='EISDIR', path=path)
    except BaseException:
        os.close(fd)
        raise
    handle = FileRead()
    conn.register(req_id, handle)
    seekable = stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)  # pipes, character devices: plain read()

    def stream():
        sent = 0
        try:
            offset = f.get('offset') or 0
            remaining = f.get('length')
            while not handle.cancelled:
                n = MAX_CHUNK if remaining is None else min(MAX_CHUNK, remaining)
                if n <= 0:
                    break
                data = os.pread(fd, n, offset) if seekable else os.read(fd, n)
                if not data:
                    break
                offset += len(data)
                sent += len(data)
                if remaining is not None:
                    remaining -= len(data)
                if not conn.send({'t': 'ev', 'id': req_id, 'ev': 'chunk', 'data': data}):
                    return
            if handle.cancelled:
                conn.finish_error(req_id, 'cancelled', 'read cancelled')
            else:
                conn.finish(req_id, {'t': 'res', 'id': req_id, 'size': sent, 'fileSize': st.st_size})
        except OSError as e:
            e2 = os_error(e, path)
            conn.finish_error(req_id, e2.code, e2.message, **e2.details)
        finally:
            os.close(fd)

    run_thread(stream, name='files-read')
    return None


class FileWrite:
    """A streamed files.write: the connection's reader thread writes each chunk
    as it arrives (so a slow disk slows the sender: back-pressure)."""

    def __init__(self, conn, req_id, path, fd, size):
        self.conn, self.req_id, self.path, self.fd, self.size = conn, req_id, path, fd, size
        self.failed = False

    def on_input(self, ev, frame):
        if self.failed:  # an error was answered; swallow the rest until end or cancel
            if ev == 'end':
                with self.conn.open_lock:
                    self.conn.open.pop(self.req_id, None)
            return
        try:
            if ev == 'data':
                view = memoryview(frame['data'])
                while view:
                    k = os.write(self.fd, view)
                    view = view[k:]
                self.size += len(frame['data'])
                return
            os.close(self.fd)
            self.fd = None
            self.conn.finish(self.req_id, {'t': 'res', 'id': self.req_id, 'size': self.size})
        except OSError as e:
            self._fail(os_error(e, self.path))

    def _fail(self, e):
        self.failed = True
        self._close()
        self.conn.error(self.req_id, e.code, e.message, **e.details)

    def _close(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    def cancel(self):
        with self.conn.open_lock:
            self.conn.open.pop(self.req_id, None)
        self._close()
        if not self.failed:
            self.conn.error(self.req_id, 'cancelled', 'write cancelled; the file may be partly written')


def op_files_write(agent, conn, f):
    path = f['path']
    if f.get('mkdirs'):
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if f.get('append') else os.O_TRUNC)
    mode = f.get('mode')
    try:
        fd = os.open(path, flags, 0o644 if mode is None else mode)
    except OSError as e:
        raise os_error(e, path)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        size = 0
        data = f.get('data')
        if data:
            view = memoryview(data)
            while view:
                k = os.write(fd, view)
                view = view[k:]
            size = len(data)
    except OSError as e:
        os.close(fd)
        raise os_error(e, path)
    if not f.get('stream'):
        os.close(fd)
        return {'size': size}
    conn.register(f['id'], FileWrite(conn, f['id'], path, fd, size))
    return None


def _wrap_os(fn):
    def op(agent, conn, f):
        try:
            return fn(agent, conn, f)
        except OSError as e:
            raise os_error(e, f.get('path') or f.get('from'))
    return op


@_wrap_os
def op_files_list(agent, conn, f):
    entries = []
    with os.scandir(f['path']) as it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            d = _stat_fields(st)
            d['name'] = e.name
            entries.append(d)
    entries.sort(key=lambda d: d['name'])
    return {'entries': entries}


@_wrap_os
def op_files_stat(agent, conn, f):
    st = os.stat(f['path']) if f.get('follow', True) else os.lstat(f['path'])
    d = _stat_fields(st)
    d.update(uid=st.st_uid, gid=st.st_gid)
    return d


def op_files_exists(agent, conn, f):
    try:
        st = os.lstat(f['path'])
    except FileNotFoundError:
        return {'exists': False, 'type': None}
    except NotADirectoryError:
        return {'exists': False, 'type': None}
    except OSError as e:
        raise os_error(e, f['path'])
    return {'exists': True, 'type': _stat_fields(st)['type']}


@_wrap_os
def op_files_mkdir(agent, conn, f):
    path, mode = f['path'], f.get('mode', 0o755)
    if f.get('parents', True):
        existed = os.path.isdir(path)
        os.makedirs(path, mode, exist_ok=True)
        return {'created': not existed}
    os.mkdir(path, mode)
    return {'created': True}


@_wrap_os
def op_files_remove(agent, conn, f):
    path = f['path']
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if f.get('force'):
            return {'removed': False}
        raise
    if stat.S_ISDIR(st.st_mode):
        if f.get('recursive'):
            shutil.rmtree(path)
        else:
            os.rmdir(path)
    else:
        os.unlink(path)
    return {'removed': True}


@_wrap_os
def op_files_rename(agent, conn, f):
    try:
        os.rename(f['from'], f['to'])
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.move(f['from'], f['to'])
    return {'done': True}


def op_restore(agent, conn, f):
    t0 = time.perf_counter()
    allowed = agent.config['system_ops']
    res = {'reseeded': []}
    entropy = f.get('entropy') or b''
    if not entropy:
        res['entropy'] = {'added': False, 'bytes': 0, 'reason': 'no entropy given'}
    elif 'entropy' not in allowed:
        res['entropy'] = {'added': False, 'bytes': 0, 'reason': 'disabled (not PID 1; see --system-ops)'}
    else:
        try:
            if agent.random_fd is None:
                agent.random_fd = os.open('/dev/random', os.O_WRONLY | os.O_CLOEXEC)
            fcntl.ioctl(agent.random_fd, RNDADDENTROPY, struct.pack('ii', len(entropy) * 8, len(entropy)) + entropy)
            res['entropy'] = {'added': True, 'bytes': len(entropy)}
            # Credited entropy alone does not reseed an initialised CRNG (it
            # reseeds on a timer), so a VM restored from a snapshot would hand
            # every sibling the same os.urandom bytes until then: reseed now.
            try:
                fcntl.ioctl(agent.random_fd, RNDRESEEDCRNG)
            except OSError as e:
                res['entropy']['reason'] = 'added, but RNDRESEEDCRNG: %s (the kernel reseeds later)' % (e.strerror or e)
        except OSError as e:
            res['entropy'] = {'added': False, 'bytes': 0, 'reason': 'RNDADDENTROPY: %s' % (e.strerror or e)}
    # Reseed user-space generators: they were copied from the template with the
    # rest of memory and would repeat in every child otherwise.
    seed = os.urandom(32) + entropy
    random.seed(seed)
    res['reseeded'].append('random')
    np_random = sys.modules.get('numpy.random')
    if np_random is not None:
        try:
            # A whole MT19937 state from the kernel, set directly: seeding
            # from a list goes through numpy's array machinery and copies
            # ~220 KiB of the template's pages into every child (measured
            # with fork + smaps_rollup); this path ~100 KiB, with more entropy.
            np = sys.modules['numpy']
            np_random.set_state(('MT19937', np.frombuffer(os.urandom(2496), dtype=np.uint32), 624, 0, 0.0))
            res['reseeded'].append('numpy.random')
        except Exception as e:
            log('numpy.random reseed failed: %r' % e)
    ssl_mod = sys.modules.get('ssl')
    if ssl_mod is not None and entropy:
        try:
            ssl_mod.RAND_add(entropy, float(len(entropy)))
            res['reseeded'].append('ssl')
        except Exception as e:
            log('ssl.RAND_add failed: %r' % e)
    tempfile_mod = sys.modules.get('tempfile')
    if tempfile_mod is not None and getattr(tempfile_mod, '_name_sequence', None) is not None:
        tempfile_mod._name_sequence = None  # recreated (fresh Random) on next use
        res['reseeded'].append('tempfile')
    if f.get('time') is None:
        res['clock'] = {'set': False, 'reason': 'no time given'}
    elif 'clock' not in allowed:
        res['clock'] = {'set': False, 'reason': 'disabled (not PID 1; see --system-ops)'}
    else:
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, int(f['time'] * 1e9))
            res['clock'] = {'set': True}
        except OSError as e:
            res['clock'] = {'set': False, 'reason': 'clock_settime: %s' % (e.strerror or e)}
    name = f.get('hostname')
    if name is None:
        res['hostname'] = {'set': False, 'reason': 'no hostname given'}
    elif 'hostname' not in allowed:
        res['hostname'] = {'set': False, 'reason': 'disabled (not PID 1; see --system-ops)'}
    elif socket.gethostname() == name:
        res['hostname'] = {'set': True}
    else:
        try:
            socket.sethostname(name)
            res['hostname'] = {'set': True}
        except OSError as e:
            res['hostname'] = {'set': False, 'reason': 'sethostname: %s' % (e.strerror or e)}
    if f.get('sandboxId') is not None:
        agent.sandbox_id = f['sandboxId']
    res['sandboxId'] = agent.sandbox_id
    res['durationUs'] = (time.perf_counter() - t0) * 1e6
    return res


def op_shutdown(agent, conn, f):
    conn.finish(f['id'], {'t': 'res', 'id': f['id'], 'done': True})
    run_thread(agent.shutdown, bool(f.get('reboot')), name='shutdown')
    return None


OPS = {
    'hello': op_hello,
    'ping': op_ping,
    'info': op_info,
    'quiet': op_quiet,
    'eval': op_eval,
    'context.list': op_context_list,
    'context.delete': op_context_delete,
    'exec': op_exec,
    'proc.list': op_proc_list,
    'proc.wait': op_proc_wait,
    'proc.write': op_proc_write,
    'proc.closeStdin': op_proc_close_stdin,
    'proc.signal': op_proc_signal,
    'proc.kill': op_proc_kill,
    'files.read': op_files_read,
    'files.write': op_files_write,
    'files.list': op_files_list,
    'files.stat': op_files_stat,
    'files.exists': op_files_exists,
    'files.mkdir': op_files_mkdir,
    'files.remove': op_files_remove,
    'files.rename': op_files_rename,
    'restore': op_restore,
    'shutdown': op_shutdown,
}


# ------------------------------------------------------------------ PID 1


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, src, target, fstype, flags=0, data=None):
    import ctypes
    try:
        os.makedirs(target, exist_ok=True)
    except OSError:
        pass
    rc = libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                    data.encode() if data else None)
    if rc != 0:
        e = ctypes.get_errno()
        if e != errno.EBUSY:
            log('mount %s on %s: %s' % (fstype, target, os.strerror(e)))


MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


def pid1_setup():
    libc = _libc()
    _mount(libc, 'proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mounted = set()
    try:
        with open('/proc/mounts') as fh:
            mounted = {line.split()[1] for line in fh if len(line.split()) > 1}
    except OSError:
        pass
    table = [
        ('sysfs', '/sys', 'sysfs', MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
        ('devtmpfs', '/dev', 'devtmpfs', MS_NOSUID, 'mode=0755'),
        ('devpts', '/dev/pts', 'devpts', MS_NOSUID | MS_NOEXEC, 'gid=5,mode=620,ptmxmode=666'),
        ('tmpfs', '/dev/shm', 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=1777'),
        ('tmpfs', '/tmp', 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=1777'),
        ('tmpfs', '/run', 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=0755'),
    ]
    for src, target, fstype, flags, data in table:
        if target not in mounted:
            _mount(libc, src, target, fstype, flags, data)
    # the kernel gives init the console as fds 0-2 only when /dev/console existed
    try:
        os.fstat(1)
    except OSError:
        try:
            fd = os.open('/dev/console', os.O_RDWR)
            for target in (0, 1, 2):
                if fd != target:
                    os.dup2(fd, target)
            sys.__stdout__ = sys.stdout = os.fdopen(1, 'w', buffering=1)
            sys.__stderr__ = sys.stderr = os.fdopen(2, 'w', buffering=1)
        except OSError:
            pass
    os.environ.setdefault('PATH', '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')
    os.environ.setdefault('HOME', '/root')
    hostname = cmdline_value('forkling.hostname')
    if hostname is None:
        try:
            with open('/etc/hostname') as fh:
                hostname = fh.read().strip() or None
        except OSError:
            pass
    try:
        socket.sethostname(hostname or 'forkling')
    except OSError as e:
        log('sethostname: %s' % e)
    loopback_up()
    if 'FORKLING_PROCESS_ROLE' not in os.environ:  # (the process engine runs on the host's kernel: its modules are not ours to load)
        load_modules(finit_module_syscall(libc))
    run_thread(reaper, name='reaper')


def loopback_up():
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack('16sh14x', b'lo', 0)
            flags = struct.unpack('16sh14x', fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack('16sh14x', b'lo', flags | IFF_UP))
    except OSError as e:
        log('bringing up lo: %s' % e)


def parse_module_list(text):
    """[(absolute path, params)] from `<path relative to /> [params]` lines."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith('#'):
            continue
        path, _, params = line.partition(' ')
        out.append(('/' + path.lstrip('/'), params.strip()))
    return out


def load_modules(syscall, listing='/etc/forkling/modules'):
    """finit_module(fd, params, flags) for each listed module, in order.
    `syscall(fd, params_bytes, flags)` returns 0 or an errno."""
    try:
        with open(listing) as fh:
            modules = parse_module_list(fh.read())
    except FileNotFoundError:
        return []
    done = []
    for full, params in modules:
        flags = 4 if full.endswith(('.xz', '.zst', '.gz')) else 0  # MODULE_INIT_COMPRESSED_FILE
        try:
            fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            log('module %s: %s' % (full, e.strerror))
            continue
        try:
            err = syscall(fd, params.encode(), flags)
        finally:
            os.close(fd)
        if err and err != errno.EEXIST:  # EEXIST: built in or already loaded
            log('finit_module %s: %s' % (full, os.strerror(err)))
        else:
            done.append(full)
    return done


def finit_module_syscall(libc):
    import ctypes
    import platform
    nr = {'x86_64': 313, 'aarch64': 273}.get(platform.machine(), 313)

    def call(fd, params, flags):
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(fd), ctypes.c_char_p(params), ctypes.c_int(flags))
        return ctypes.get_errno() if rc != 0 else 0
    return call


def zombie_children(ppid):
    """Pids of zombie processes whose parent is ppid (from /proc)."""
    out = set()
    want = str(ppid).encode()
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/stat' % name, 'rb') as fh:
                s = fh.read()
        except OSError:
            continue
        rest = s[s.rfind(b')') + 2:].split()
        if len(rest) > 1 and rest[0] == b'Z' and rest[1] == want:
            out.add(int(name))
    return out


REAPER_TID = None  # (quiet_check)


def reaper():
    """PID 1 adopts orphans: reap zombies we did not start. A zombie child we
    do not track is reaped once seen twice (0.5 s apart), which gives code
    that waits for its own children (subprocess in an eval) time to do so.
    While the agent is idle with no zombie about, it sleeps with no timeout
    until a client frame (agent.service_wake_fd, written by
    Connection.dispatch) or the exit of one of its children (a pidfd of each:
    sleep_kids) wakes it: a tick every 0.5 s wrote, and so copied in every
    forked VM, pages of Python and of the kernel while the sandbox idled."""
    global REAPER_TID
    REAPER_TID = threading.get_native_id()
    wake = None
    seen = set()
    while True:
        agent = AGENT
        kids = None
        # (not in a process engine's zygote: its forks inherit its fds, and each runs a service
        # thread that sleeps this way itself)
        if agent is not None and not seen and 'FORKLING_PROCESS_ROLE' not in os.environ:
            if wake is None and agent.service_wake_fd is None:
                wake = agent.service_wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            if wake is not None and agent.service_wake_fd == wake and agent.idle():
                frames = agent.frames
                kids = sleep_kids(agent)  # (marks it asleep: a frame counted from now on wakes it)
                if kids is not None and (agent.frames != frames or not agent.idle()):
                    agent.service_asleep = False
                    for fd in kids:
                        os.close(fd)
                    kids = None
        if kids is None:
            time.sleep(0.5)
        else:
            try:
                poller = select.poll()
                for fd in [wake, *kids]:
                    poller.register(fd, select.POLLIN)
                poller.poll()
            finally:
                agent.service_asleep = False
                try:
                    os.eventfd_read(wake)
                except OSError:
                    pass
                for fd in kids:
                    os.close(fd)
        seen = reap_tick(seen)


MAX_SLEEP_KIDS = 64


def sleep_kids(agent):
    """Whether a service thread (this reaper; a process-engine child's
    service thread) may sleep with no timeout: None if not (a zombie to
    reap, too many children), else the pidfds of our child processes (its
    branches, processes evals left running), each of which wakes it when that
    child exits (its orphans then become ours: the next sleep watches them).
    Marks it asleep before the caller reads agent.frames, so that a frame
    counted after that read wakes it (Connection.dispatch counts, then looks)."""
    fds = []
    if IS_PID1:
        try:
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return None  # a zombie: reaped by ticks (reap_tick waits to see it twice)
            pids = children_pids()
        except ChildProcessError:
            pids = ()
        if pids is None or len(pids) > MAX_SLEEP_KIDS:
            return None
        try:
            for pid in pids:
                fds.append(os.pidfd_open(pid))
        except OSError:  # (one exited meanwhile: tick)
            for fd in fds:
                os.close(fd)
            return None
    agent.service_asleep = True
    return fds


def children_pids():
    """Pids of this process's children (of all its threads), or None if /proc does not say."""
    pids = []
    try:
        for tid in os.listdir('/proc/self/task'):
            try:
                with open('/proc/self/task/%s/children' % tid, 'rb') as fh:
                    pids.extend(int(p) for p in fh.read().split())
            except FileNotFoundError:
                if os.path.exists('/proc/self/task/%s' % tid):
                    return None  # (a kernel without it)
    except (OSError, ValueError):
        return None
    return pids


def reap_tick(seen):
    """One tick of the reaper (also run by a process-engine child's service
    thread). Looks through /proc only when some child has exited: waitid
    with WNOWAIT is one system call that allocates nothing, where a look
    through /proc every 0.5 s wrote (and so copied, in a forked sandbox)
    pages of Python objects and kernel caches even while idle."""
    try:
        exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        exited = None
    return reap_once(seen) if exited is not None else set()


def reap_once(seen):
    """One look of the reaper: reaps the untracked zombies that `seen`, what
    the last look returned, has too; returns the zombies of this look."""
    try:
        zombies = zombie_children(1)
    except OSError:
        return seen
    mine = AGENT.tracked_pids() if AGENT else set()
    for pid in zombies & seen:
        if pid not in mine:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return zombies


def pid1_poweroff(reboot):
    import ctypes
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(-1, sig)
        except OSError:
            pass
        time.sleep(0.5 if sig == signal.SIGTERM else 0.05)
    os.sync()
    libc = _libc()
    libc.reboot(ctypes.c_int(0x01234567 if reboot else 0x4321FEDC))  # RB_AUTOBOOT / RB_POWER_OFF
    log('reboot(): %s' % os.strerror(ctypes.get_errno()))
    os._exit(1)


def cmdline_value(key):
    try:
        with open('/proc/cmdline') as fh:
            for word in fh.read().split():
                if word.startswith(key + '='):
                    return word[len(key) + 1:]
    except OSError:
        pass
    return None


# --- BEGIN process engine hook (fork/branch ops live in forkling_zygote.py) ---
try:
    import forkling_zygote
except ImportError:  # an image without it: no fork/branch ops
    forkling_zygote = None
if forkling_zygote is not None:
    forkling_zygote.register(sys.modules[__name__])
# --- END process engine hook ---


# ------------------------------------------------------------------ main

AGENT = None


def parse_args(argv):
    cfg = {'unix': None, 'vsock': None, 'max_memory': None,
           'system_ops': {'entropy', 'clock', 'hostname'} if IS_PID1 else set()}
    it = iter(argv)
    for a in it:
        if a in ('-h', '--help'):
            sys.__stdout__.write(__doc__)
            sys.exit(0)
        try:
            v = next(it)
        except StopIteration:
            sys.exit('forkling-agent: %s needs a value' % a)
        if a == '--unix':
            cfg['unix'] = v
        elif a == '--vsock':
            cfg['vsock'] = int(v)
        elif a == '--max-memory':
            cfg['max_memory'] = int(v)
        elif a == '--system-ops':
            ops = {'all': {'entropy', 'clock', 'hostname'}, 'none': set()}.get(v)
            cfg['system_ops'] = ops if ops is not None else {x for x in v.split(',') if x}
        else:
            sys.exit('forkling-agent: unknown option %s (see --help)' % a)
    if cfg['unix'] is None and cfg['vsock'] is None:
        if IS_PID1:
            port = cmdline_value('forkling.port')
            cfg['vsock'] = int(port) if port and port.isdigit() else DEFAULT_VSOCK_PORT
        else:
            sys.exit('forkling-agent: give --unix PATH or --vsock PORT')
    return cfg


def main(argv):
    global AGENT
    cfg = parse_args(argv)
    if cfg['max_memory']:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (cfg['max_memory'], cfg['max_memory']))
    if IS_PID1:
        pid1_setup()
    agent = AGENT = Agent(cfg)
    agent.install_io()
    where = []
    if cfg['unix']:
        agent.listen_unix(cfg['unix'])
        where.append('unix=%s' % cfg['unix'])
    if cfg['vsock'] is not None:
        agent.listen_vsock(cfg['vsock'])
        where.append('port=%d' % cfg['vsock'])
    sys.__stdout__.write('forkling-agent ready %s\n' % ' '.join(where))
    sys.__stdout__.flush()
    agent.eval_loop()


if __name__ == '__main__':
    main(sys.argv[1:])
