// virtio-vsock (native/src/vmm/virtio_vsock.cc) without KVM: a fake guest
// driver in an ArrayBuffer on one side, real Unix sockets on the other.
// Valid traffic (host- and guest-initiated connections, data both ways,
// credit flow control, shutdown, refusal, transport reset), hostile packets
// and descriptor chains, and a bounded, seeded fuzz.
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'uvu';
import * as assert from 'uvu/assert';
import { DESC_F_NEXT, FakeDriver, type FakeQueue, VIRTIO_F_INDIRECT_DESC, VIRTIO_F_VERSION_1 } from './virtio-driver.ts';

const HDR = 44;
const CID = 3n;
const HOST_CID = 2n;
const OP = { REQUEST: 1, RESPONSE: 2, RST: 3, SHUTDOWN: 4, RW: 5, CREDIT_UPDATE: 6, CREDIT_REQUEST: 7 } as const;
const SHUT_RCV = 1;
const SHUT_SEND = 2;
const DEVICE_BUF_ALLOC = 256 * 1024;

interface Hdr {
  srcCid: bigint;
  dstCid: bigint;
  srcPort: number;
  dstPort: number;
  len: number;
  type: number;
  op: number;
  flags: number;
  bufAlloc: number;
  fwdCnt: number;
}

interface Packet {
  hdr: Hdr;
  data: Buffer;
}

function encodeHdr(h: Hdr): Uint8Array {
  const b = new Uint8Array(HDR);
  const v = new DataView(b.buffer);
  v.setBigUint64(0, BigInt.asUintN(64, h.srcCid), true);
  v.setBigUint64(8, BigInt.asUintN(64, h.dstCid), true);
  v.setUint32(16, h.srcPort >>> 0, true);
  v.setUint32(20, h.dstPort >>> 0, true);
  v.setUint32(24, h.len >>> 0, true);
  v.setUint16(28, h.type & 0xffff, true);
  v.setUint16(30, h.op & 0xffff, true);
  v.setUint32(32, h.flags >>> 0, true);
  v.setUint32(36, h.bufAlloc >>> 0, true);
  v.setUint32(40, h.fwdCnt >>> 0, true);
  return b;
}

function decodeHdr(b: Uint8Array): Hdr {
  const v = new DataView(b.buffer, b.byteOffset, HDR);
  return {
    srcCid: v.getBigUint64(0, true),
    dstCid: v.getBigUint64(8, true),
    srcPort: v.getUint32(16, true),
    dstPort: v.getUint32(20, true),
    len: v.getUint32(24, true),
    type: v.getUint16(28, true),
    op: v.getUint16(30, true),
    flags: v.getUint32(32, true),
    bufAlloc: v.getUint32(36, true),
    fwdCnt: v.getUint32(40, true),
  };
}

/** The guest side: a fake driver with rx/tx/event queues and a packet view. */
class Guest {
  readonly d: FakeDriver;
  rx!: FakeQueue;
  tx!: FakeQueue;
  ev!: FakeQueue;
  received: Packet[] = [];
  events: number[] = [];
  private rxBufs = new Map<number, number>();
  private evBufs = new Map<number, number>();
  private mark: number;

  constructor(
    readonly socketPath: string,
    readonly opts: { memorySize?: number; rxBuffers?: number; rxSize?: number; indirect?: boolean } = {},
  ) {
    this.d = new FakeDriver('vsock', { memorySize: opts.memorySize ?? 4 << 20, guestCid: CID, socketPath });
    this.mark = this.d.mark;
    this.activate();
  }

  activate(): void {
    this.d.rewind(this.mark);
    this.received = [];
    this.events = [];
    this.rxBufs.clear();
    this.evBufs.clear();
    const features = VIRTIO_F_VERSION_1 | (this.opts.indirect === false ? 0n : VIRTIO_F_INDIRECT_DESC);
    [this.rx, this.tx, this.ev] = this.d.setup([64, 64, 8], features) as [FakeQueue, FakeQueue, FakeQueue];
    this.postRx(this.opts.rxBuffers ?? 32);
    for (let i = 0; i < 4; i++) {
      const at = this.d.buffer(4);
      this.evBufs.set(this.ev.addChain([{ addr: at, len: 4, write: true }]), at);
    }
    this.ev.kick();
  }

  /** Rx buffers like Linux 6.1 posts them: a header buffer and a payload buffer. */
  postRx(n: number): void {
    const size = this.opts.rxSize ?? 4096;
    for (let i = 0; i < n; i++) {
      const at = this.d.buffer(HDR + size);
      const head = this.rx.addChain(
        [
          { addr: at, len: HDR, write: true },
          { addr: at + HDR, len: size, write: true },
        ],
        { indirect: this.opts.indirect !== false && i % 2 === 1 },
      );
      this.rxBufs.set(head, at);
    }
    this.rx.kick();
  }

  /** Moves used rx buffers into `received` (and reposts), used events into `events`. */
  pump(): void {
    const used = this.rx.takeUsed();
    for (const e of used) {
      const at = this.rxBufs.get(e.id);
      assert.ok(at !== undefined, `used rx id ${e.id} is one we posted`);
      this.rxBufs.delete(e.id);
      assert.ok(e.len >= HDR, `rx used length ${e.len} holds a header`);
      const hdr = decodeHdr(this.d.bytes.subarray(at!, at! + HDR));
      assert.is(e.len, HDR + hdr.len, 'used length = header + payload');
      this.received.push({ hdr, data: Buffer.from(this.d.bytes.slice(at! + HDR, at! + HDR + hdr.len)) });
    }
    if (used.length > 0 && !this.d.device.failure()) this.postRx(used.length);
    for (const e of this.ev.takeUsed()) {
      const at = this.evBufs.get(e.id)!;
      assert.is(e.len, 4);
      this.events.push(this.d.view.getUint32(at, true));
    }
    this.tx.takeUsed();
  }

  /** Sends one packet on the tx queue (header and payload in separate buffers). */
  send(h: Partial<Hdr>, payload?: Uint8Array): void {
    const hdr: Hdr = {
      srcCid: CID,
      dstCid: HOST_CID,
      srcPort: 0,
      dstPort: 0,
      len: payload?.length ?? 0,
      type: 1,
      op: OP.RW,
      flags: 0,
      bufAlloc: 65536,
      fwdCnt: 0,
      ...h,
    };
    const ha = this.d.buffer(HDR, encodeHdr(hdr));
    const bufs = [{ addr: ha, len: HDR, write: false }];
    if (payload && payload.length > 0) bufs.push({ addr: this.d.buffer(payload.length, payload), len: payload.length, write: false });
    this.tx.addChain(bufs, { indirect: this.opts.indirect !== false && bufs.length > 1 });
    this.tx.kick();
  }

  /** Waits for (and removes) the first received packet matching `pred`. */
  async recv(pred: (p: Packet) => boolean, what: string, timeoutMs = 5000): Promise<Packet> {
    let found: Packet | undefined;
    await this.d.until(
      () => {
        this.pump();
        const i = this.received.findIndex(pred);
        if (i < 0) return false;
        found = this.received.splice(i, 1)[0];
        return true;
      },
      what,
      timeoutMs,
    );
    return found!;
  }

  /** Waits for the event queue to carry the transport reset event (id 0), and nothing else. */
  async resetEvent(): Promise<void> {
    await this.d.until(
      () => {
        this.pump();
        return this.events.length > 0;
      },
      'the transport reset event',
    );
    assert.equal(this.events, [0]);
  }

  /** Processes everything queued so far (device loop pass) and pumps. */
  settle(): void {
    assert.ok(this.d.device.sync(5000), 'device sync');
    this.pump();
  }

  close(): void {
    this.d.close();
  }
}

let dir = '';
let seq = 0;
function sockPath(): string {
  if (!dir) dir = mkdtempSync(join(tmpdir(), 'forkling-vsock-test-'));
  return join(dir, `v${seq++}.sock`);
}

type GuestOptions = ConstructorParameters<typeof Guest>[1];
type GuestBody = (g: Guest) => Promise<void> | void;

/** Runs `body` with a guest on a fresh socket path and closes the guest after, whatever happens. */
function withGuest(body: GuestBody): Promise<void>;
function withGuest(opts: GuestOptions, body: GuestBody): Promise<void>;
async function withGuest(a: GuestOptions | GuestBody, b?: GuestBody): Promise<void> {
  const [opts, body] = typeof a === 'function' ? [undefined, a] : [a, b!];
  const g = new Guest(sockPath(), opts);
  try {
    await body(g);
  } finally {
    g.close();
  }
}

function connectHost(path: string): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const s = createConnection(path, () => {
      s.off('error', reject);
      // Resets (the device closing with unread bytes) show up as 'close'.
      s.on('error', () => {});
      resolve(s);
    });
    s.once('error', reject);
  });
}

/** A host connection that keeps, as text, everything the device sends on it. */
async function connectCollecting(path: string): Promise<{ host: Socket; text: () => string }> {
  const host = await connectHost(path);
  let data = '';
  host.on('data', (c) => {
    data += c.toString();
  });
  return { host, text: () => data };
}

/** Reads from `s` until `n` bytes (or a line with `untilLine`) arrived. */
function readBytes(s: Socket, n: number, timeoutMs = 5000): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let got = 0;
    const t = setTimeout(() => done(new Error(`host read: ${got} of ${n} bytes within ${timeoutMs} ms`)), timeoutMs);
    const onData = (c: Buffer) => {
      chunks.push(c);
      got += c.length;
      if (got >= n) done();
    };
    const onEnd = () => done(new Error(`host read: connection ended after ${got} of ${n} bytes`));
    function done(err?: Error) {
      clearTimeout(t);
      s.off('data', onData);
      s.off('end', onEnd);
      s.pause();
      const all = Buffer.concat(chunks);
      if (all.length > n) s.unshift(all.subarray(n));
      if (err) reject(err);
      else resolve(all.subarray(0, n));
    }
    s.on('data', onData);
    s.once('end', onEnd);
    s.resume();
  });
}

function readLine(s: Socket, timeoutMs = 5000): Promise<string> {
  return new Promise((resolve, reject) => {
    let buf = Buffer.alloc(0);
    const t = setTimeout(() => done(new Error(`no line within ${timeoutMs} ms (got ${JSON.stringify(buf.toString())})`)), timeoutMs);
    const onData = (c: Buffer) => {
      buf = Buffer.concat([buf, c]);
      if (buf.includes(10)) done();
    };
    const onClose = () => done(new Error(`connection closed before a line (got ${JSON.stringify(buf.toString())})`));
    function done(err?: Error) {
      clearTimeout(t);
      s.off('data', onData);
      s.off('close', onClose);
      s.pause();
      const i = buf.indexOf(10);
      if (i >= 0 && i + 1 < buf.length) s.unshift(buf.subarray(i + 1));
      if (err) reject(err);
      else resolve(buf.subarray(0, i + 1).toString());
    }
    s.on('data', onData);
    s.once('close', onClose);
    s.resume();
  });
}

function closed(s: Socket, timeoutMs = 5000): Promise<void> {
  return new Promise((resolve, reject) => {
    if (s.destroyed) return resolve();
    const t = setTimeout(() => reject(new Error(`host socket not closed within ${timeoutMs} ms`)), timeoutMs);
    s.once('close', () => {
      clearTimeout(t);
      resolve();
    });
    s.resume();
  });
}

function listen(path: string): Promise<{ server: Server; next: () => Promise<Socket> }> {
  const pending: Socket[] = [];
  const waiters: ((s: Socket) => void)[] = [];
  const server = createServer((s) => {
    const w = waiters.shift();
    if (w) w(s);
    else pending.push(s);
  });
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(path, () =>
      resolve({
        server,
        next: () => {
          const s = pending.shift();
          if (s) return Promise.resolve(s);
          return new Promise((r, j) => {
            const t = setTimeout(() => j(new Error('no connection on the host listener')), 5000);
            waiters.push((x) => {
              clearTimeout(t);
              r(x);
            });
          });
        },
      }),
    );
  });
}

const isOp = (op: number, port?: number) => (p: Packet) => p.hdr.op === op && (port === undefined || p.hdr.srcPort === port);

/** Host connects with CONNECT <port>; the guest accepts. Returns the host socket and the device's host port. */
async function hostConnect(g: Guest, guestPort: number, bufAlloc = 65536): Promise<{ host: Socket; hostPort: number }> {
  const host = await connectHost(g.socketPath);
  host.write(`CONNECT ${guestPort}\n`);
  const req = await g.recv((p) => p.hdr.op === OP.REQUEST && p.hdr.dstPort === guestPort, 'OP_REQUEST');
  assert.is(req.hdr.srcCid, HOST_CID);
  assert.is(req.hdr.dstCid, CID);
  assert.is(req.hdr.type, 1);
  assert.is(req.hdr.len, 0);
  assert.ok(req.hdr.srcPort >= 2 ** 30, 'host port from the device range');
  assert.is(req.hdr.bufAlloc, DEVICE_BUF_ALLOC);
  g.send({ op: OP.RESPONSE, srcPort: guestPort, dstPort: req.hdr.srcPort, bufAlloc });
  const line = await readLine(host);
  assert.is(line, `OK ${req.hdr.srcPort}\n`);
  return { host, hostPort: req.hdr.srcPort };
}

test('config space holds the guest CID; features are VERSION_1 and INDIRECT_DESC', () =>
  withGuest((g) => {
    const dev = g.d.device;
    assert.is(dev.deviceId(), 19);
    assert.is(dev.numQueues(), 3);
    assert.is(dev.deviceFeatures(), VIRTIO_F_VERSION_1 | VIRTIO_F_INDIRECT_DESC);
    assert.equal([...dev.readConfig(0, 8)], [3, 0, 0, 0, 0, 0, 0, 0]);
    assert.equal([...dev.readConfig(0, 12)], [3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 'past the end reads 0');
    assert.equal([...dev.readConfig(4294967295, 4)], [0, 0, 0, 0], 'offset overflow reads 0');
    dev.writeConfig(0, new Uint8Array([9]));
    assert.equal([...dev.readConfig(0, 1)], [3], 'read-only');
  }));

test('host-initiated connection: CONNECT, OK, data both ways, guest close answered with RST', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 1024);
    // host -> guest
    host.write('hello guest');
    const rw = await g.recv(isOp(OP.RW, hostPort), 'RW to the guest');
    assert.is(rw.data.toString(), 'hello guest');
    assert.is(rw.hdr.dstPort, 1024);
    assert.is(rw.hdr.bufAlloc, DEVICE_BUF_ALLOC);
    // guest -> host
    g.send({ srcPort: 1024, dstPort: hostPort, op: OP.RW, fwdCnt: 11 }, Buffer.from('hello host'));
    assert.is((await readBytes(host, 10)).toString(), 'hello host');
    // Bytes that follow the CONNECT line in the same write belong to the stream.
    const h2 = await connectHost(g.socketPath);
    h2.write('CONNECT 1025\nearly bytes');
    const req = await g.recv(isOp(OP.REQUEST), 'second OP_REQUEST');
    g.send({ op: OP.RESPONSE, srcPort: 1025, dstPort: req.hdr.srcPort });
    assert.is(await readLine(h2), `OK ${req.hdr.srcPort}\n`);
    assert.is((await g.recv(isOp(OP.RW, req.hdr.srcPort), 'early bytes')).data.toString(), 'early bytes');
    assert.is(g.d.device.stats().connections, 2);
    // The guest closes: SHUTDOWN both ways; the device answers RST and closes the Unix side.
    g.send({ srcPort: 1024, dstPort: hostPort, op: OP.SHUTDOWN, flags: SHUT_RCV | SHUT_SEND });
    await g.recv(isOp(OP.RST, hostPort), 'RST answering the shutdown');
    await closed(host);
    // The host closes completely: SHUTDOWN both ways; the guest answers RST.
    h2.destroy();
    const sd = await g.recv(isOp(OP.SHUTDOWN, req.hdr.srcPort), 'SHUTDOWN after the host closed');
    assert.is(sd.hdr.flags, SHUT_RCV | SHUT_SEND);
    g.send({ srcPort: 1025, dstPort: req.hdr.srcPort, op: OP.RST });
    g.settle();
    assert.is(g.d.device.stats().connections, 0);
    assert.is(g.d.device.failure(), null);
  }));

test('host end: SHUTDOWN(SEND) to the guest, then the guest close ends the connection', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 2000);
    host.write('last words');
    host.end();
    const rw = await g.recv(isOp(OP.RW, hostPort), 'data before the end');
    assert.is(rw.data.toString(), 'last words');
    const sd = await g.recv(isOp(OP.SHUTDOWN, hostPort), 'SHUTDOWN');
    assert.ok(sd.hdr.flags & SHUT_SEND, 'SEND flag');
    // Half-close: the guest can still answer.
    g.send({ srcPort: 2000, dstPort: hostPort, op: OP.RW }, Buffer.from('reply'));
    assert.is((await readBytes(host, 5)).toString(), 'reply');
    g.send({ srcPort: 2000, dstPort: hostPort, op: OP.SHUTDOWN, flags: SHUT_SEND });
    await closed(host);
    await g.recv(isOp(OP.RST, hostPort), 'RST: both directions done');
  }));

test('a host that connects before the driver is up is served once it is', () =>
  withGuest(async (g) => {
    g.d.device.reset(); // as after a guest reboot: not active
    const host = await connectHost(g.socketPath);
    host.write('CONNECT 1500\n');
    assert.ok(g.d.device.sync(1000));
    g.activate();
    const req = await g.recv(isOp(OP.REQUEST), 'OP_REQUEST after activation');
    assert.is(req.hdr.dstPort, 1500);
    g.send({ op: OP.RESPONSE, srcPort: 1500, dstPort: req.hdr.srcPort });
    assert.is(await readLine(host), `OK ${req.hdr.srcPort}\n`);
    host.destroy();
  }));

test('the guest refuses (RST): the host connection closes without OK', () =>
  withGuest(async (g) => {
    const { host, text } = await connectCollecting(g.socketPath);
    host.write('CONNECT 9999\n');
    const req = await g.recv(isOp(OP.REQUEST), 'OP_REQUEST');
    g.send({ op: OP.RST, srcPort: 9999, dstPort: req.hdr.srcPort });
    await closed(host);
    assert.is(text(), '');
    g.settle();
    assert.is(g.d.device.stats().connections, 0);
  }));

test('a bad CONNECT line gets an ERROR line and a close', () =>
  withGuest(async (g) => {
    for (const line of ['HELLO\n', 'CONNECT\n', 'CONNECT -1\n', 'CONNECT 4294967296\n', 'CONNECT 12a\n', `CONNECT ${'1'.repeat(40)}\n`]) {
      const { host, text } = await connectCollecting(g.socketPath);
      host.write(line);
      await closed(host);
      if (line.length <= 33) assert.match(text(), /^ERROR /, `answer to ${JSON.stringify(line)}`);
    }
    g.settle();
    assert.is(g.received.length, 0, 'the guest heard nothing');
  }));

test('guest-initiated connection to <socket>_<port>; no listener means RST', () =>
  withGuest(async (g) => {
    const { server, next } = await listen(`${g.socketPath}_5000`);
    try {
      g.send({ op: OP.REQUEST, srcPort: 7777, dstPort: 5000, bufAlloc: 65536 });
      const resp = await g.recv(isOp(OP.RESPONSE, 5000), 'OP_RESPONSE');
      assert.is(resp.hdr.dstPort, 7777);
      const s = await next();
      g.send({ op: OP.RW, srcPort: 7777, dstPort: 5000 }, Buffer.from('ping'));
      assert.is((await readBytes(s, 4)).toString(), 'ping');
      s.write('pong');
      assert.is((await g.recv(isOp(OP.RW, 5000), 'pong')).data.toString(), 'pong');
      // A second REQUEST on the same ports is a protocol error: reset.
      g.send({ op: OP.REQUEST, srcPort: 7777, dstPort: 5000 });
      await g.recv(isOp(OP.RST, 5000), 'RST for a duplicate request');
      await closed(s);
      // The host side writes its last bytes and closes at once: the bytes
      // still arrive, then SHUTDOWN both ways.
      g.send({ op: OP.REQUEST, srcPort: 7779, dstPort: 5000, bufAlloc: 65536 });
      await g.recv(isOp(OP.RESPONSE, 5000), 'second OP_RESPONSE');
      const s2 = await next();
      s2.end('bye');
      assert.is((await g.recv((p) => p.hdr.op === OP.RW && p.hdr.dstPort === 7779, 'last bytes')).data.toString(), 'bye');
      const sd = await g.recv((p) => p.hdr.op === OP.SHUTDOWN && p.hdr.dstPort === 7779, 'SHUTDOWN');
      assert.ok(sd.hdr.flags & SHUT_SEND);
      // Nobody listens on 5001.
      g.send({ op: OP.REQUEST, srcPort: 7778, dstPort: 5001 });
      const rst = await g.recv(isOp(OP.RST, 5001), 'RST for port 5001');
      assert.is(rst.hdr.dstPort, 7778);
    } finally {
      server.close();
    }
  }));

test('credit: the device never sends more than the guest advertised', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 3000, 1000);
    const payload = Buffer.alloc(5000);
    for (let i = 0; i < payload.length; i++) payload[i] = (i * 7) & 0xff;
    await new Promise<void>((r) => host.write(payload, () => r()));
    let got = Buffer.alloc(0);
    for (let fwd = 1000; fwd <= 5000; fwd += 1000) {
      await g.d.until(
        () => {
          g.pump();
          for (const p of g.received.splice(0)) {
            if (p.hdr.op === OP.RW) got = Buffer.concat([got, p.data]);
            else assert.ok(p.hdr.op === OP.CREDIT_REQUEST, `unexpected op ${p.hdr.op}`);
          }
          return got.length >= fwd;
        },
        `${fwd} bytes`,
      );
      g.settle();
      for (const p of g.received.splice(0)) if (p.hdr.op === OP.RW) got = Buffer.concat([got, p.data]);
      assert.is(got.length, fwd, 'nothing beyond the credit');
      // The guest consumed it all: more credit.
      g.send({ op: OP.CREDIT_UPDATE, srcPort: 3000, dstPort: hostPort, bufAlloc: 1000, fwdCnt: fwd });
    }
    assert.ok(got.equals(payload), 'the stream arrived intact and in order');
  }));

test('credit: the device advertises its buffer and sends CREDIT_UPDATE as it forwards', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 3001);
    const chunk = Buffer.alloc(65536, 0x61);
    for (let i = 0; i < 3; i++) g.send({ op: OP.RW, srcPort: 3001, dstPort: hostPort }, chunk);
    await readBytes(host, 3 * 65536);
    const upd = await g.recv((p) => p.hdr.op === OP.CREDIT_UPDATE || (p.hdr.op === OP.RW && p.hdr.fwdCnt > 0), 'credit update');
    assert.ok(upd.hdr.fwdCnt >= 65536, `fwd_cnt ${upd.hdr.fwdCnt}`);
    assert.is(upd.hdr.bufAlloc, DEVICE_BUF_ALLOC);
    // A credit request is answered with the current count.
    g.settle();
    g.received.length = 0;
    g.send({ op: OP.CREDIT_REQUEST, srcPort: 3001, dstPort: hostPort });
    const ans = await g.recv(isOp(OP.CREDIT_UPDATE, hostPort), 'answer to CREDIT_REQUEST');
    assert.is(ans.hdr.fwdCnt, 3 * 65536);
  }));

test('credit: a guest sending beyond its credit is reset', () =>
  withGuest({ memorySize: 8 << 20 }, async (g) => {
    const { host, hostPort } = await hostConnect(g, 3002);
    host.pause(); // the host reads nothing: data piles up in the device
    const chunk = Buffer.alloc(65536, 0x62);
    for (let i = 0; i < 12; i++) g.send({ op: OP.RW, srcPort: 3002, dstPort: hostPort }, chunk);
    await g.recv(isOp(OP.RST, hostPort), 'RST for the credit overrun');
    assert.ok(g.d.device.stats().badPackets >= 1);
    await closed(host);
    assert.is(g.d.device.failure(), null, 'a misbehaving connection does not fail the device');
  }));

test('transport reset: event 0 to the guest, all connections dropped', () =>
  withGuest(async (g) => {
    const { host } = await hostConnect(g, 4000);
    g.d.device.transportReset();
    await g.resetEvent();
    await closed(host);
    g.settle();
    assert.is(g.d.device.stats().connections, 0);
    // New connections work afterwards.
    const again = await hostConnect(g, 4001);
    again.host.destroy();
  }));

test('bulk: 2 MiB each way through credit flow control, in order', () =>
  withGuest({ memorySize: 16 << 20 }, async (g) => {
    const GUEST_BUF = 256 * 1024;
    const { host, hostPort } = await hostConnect(g, 4500, GUEST_BUF);
    const size = 2 << 20;
    const toGuest = Buffer.alloc(size);
    const toHost = Buffer.alloc(size);
    for (let i = 0; i < size; i++) {
      toGuest[i] = (i * 31 + (i >> 11)) & 0xff;
      toHost[i] = (i * 17 + (i >> 13)) & 0xff;
    }
    host.write(toGuest);
    const fromGuest: Buffer[] = [];
    let hostGot = 0;
    host.on('data', (c: Buffer) => {
      fromGuest.push(c);
      hostGot += c.length;
      g.d.poke(); // re-check the condition below
    });
    host.resume();
    // The guest side: consume RW (granting credit as it goes, like Linux) and
    // send its own data within the credit the device grants.
    let got = Buffer.alloc(0);
    let consumedSinceUpdate = 0;
    let sent = 0;
    let devBufAlloc = 0;
    let devFwdCnt = 0;
    await g.d.until(
      () => {
        g.pump();
        for (const p of g.received.splice(0)) {
          assert.is(p.hdr.dstPort, 4500);
          devBufAlloc = p.hdr.bufAlloc;
          devFwdCnt = p.hdr.fwdCnt;
          if (p.hdr.op === OP.RW) {
            got = Buffer.concat([got, p.data]);
            consumedSinceUpdate += p.data.length;
          }
        }
        if (consumedSinceUpdate >= 64 * 1024) {
          g.send({ op: OP.CREDIT_UPDATE, srcPort: 4500, dstPort: hostPort, bufAlloc: GUEST_BUF, fwdCnt: got.length });
          consumedSinceUpdate = 0;
        }
        while (sent < size && g.tx.freeCount >= 2) {
          const credit = devBufAlloc - (sent - devFwdCnt);
          const n = Math.min(65536, size - sent, credit);
          if (n <= 0) break;
          g.send({ op: OP.RW, srcPort: 4500, dstPort: hostPort, fwdCnt: got.length, bufAlloc: GUEST_BUF }, toHost.subarray(sent, sent + n));
          sent += n;
        }
        if (got.length >= size && consumedSinceUpdate > 0) {
          g.send({ op: OP.CREDIT_UPDATE, srcPort: 4500, dstPort: hostPort, bufAlloc: GUEST_BUF, fwdCnt: got.length });
          consumedSinceUpdate = 0;
        }
        return got.length >= size && hostGot >= size;
      },
      'both transfers',
      30_000,
    );
    assert.ok(got.equals(toGuest), 'host -> guest intact');
    assert.ok(Buffer.concat(fromGuest).equals(toHost), 'guest -> host intact');
    assert.is(g.d.device.failure(), null);
  }));

test('without indirect descriptors, with small rx buffers: data is split across buffers', () =>
  withGuest({ indirect: false, rxSize: 100 }, async (g) => {
    const { host, hostPort } = await hostConnect(g, 4100);
    const msg = Buffer.from('x'.repeat(1000));
    host.write(msg);
    let got = Buffer.alloc(0);
    while (got.length < 1000) {
      const p = await g.recv(isOp(OP.RW, hostPort), 'RW piece');
      assert.ok(p.data.length <= 100);
      got = Buffer.concat([got, p.data]);
    }
    assert.ok(got.equals(msg));
  }));

test('snapshot: pause holds the device still, resume continues', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 4200);
    g.d.device.pause();
    host.write('while paused');
    g.send({ op: OP.RW, srcPort: 4200, dstPort: hostPort }, Buffer.from('to host'));
    const txBefore = g.d.device.stats().txPackets;
    // Give the (stopped) device every chance to act: a round trip through the host socket.
    await new Promise<void>((r) => host.write('', () => r()));
    assert.is(g.tx.usedIdx(), g.d.device.saveState().queues[1]!.nextUsed, 'tx ring position saved as is');
    assert.is(g.d.device.stats().txPackets, txBefore, 'nothing processed while paused');
    g.d.device.resume();
    assert.is((await readBytes(host, 7)).toString(), 'to host');
    assert.is((await g.recv(isOp(OP.RW, hostPort), 'data after resume')).data.toString(), 'while paused');
  }));

test("snapshot: the guest resetting and activating the device again does not end the VMM's hold", () =>
  withGuest(async (g) => {
    g.d.device.pause();
    g.d.device.reset();
    g.activate();
    g.send({ op: OP.RW, srcPort: 4300, dstPort: 77 }, Buffer.from('x'));
    const txBefore = g.d.device.stats().txPackets;
    assert.ok(g.d.device.sync(5000), 'device sync');
    assert.is(g.d.device.stats().txPackets, txBefore, 'nothing processed while held');
    g.d.device.resume();
    assert.ok(g.d.device.sync(5000), 'device sync');
    assert.is(g.d.device.stats().txPackets, txBefore + 1, 'processed after resume');
  }));

test('credit granted a byte at a time, no rx buffers: host data waits as one packet, not one per byte', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 4400, 1);
    await new Promise<void>((r) => host.write(Buffer.alloc(300, 0x61), () => r()));
    // Only the tx queue is served from here on: the rx buffers run out, the rest waits in the device.
    for (let credit = 1; credit <= 300; credit++) {
      g.send({ op: OP.CREDIT_UPDATE, srcPort: 4400, dstPort: hostPort, bufAlloc: credit, fwdCnt: 0 });
      assert.ok(g.d.device.sync(5000), 'device sync');
      g.tx.takeUsed();
    }
    let bytes = 0;
    let packets = 0;
    await g.d.until(
      () => {
        g.pump();
        for (const p of g.received.splice(0)) {
          if (p.hdr.op !== OP.RW) continue;
          bytes += p.data.length;
          packets++;
        }
        return bytes >= 300;
      },
      '300 bytes',
    );
    assert.is(bytes, 300);
    assert.ok(packets < 64, `${packets} packets for 300 bytes (one per rx buffer the guest had, then one)`);
    host.destroy();
  }));

/** Threads of this process named "vsock": the device loops'. */
function vsockThreads(): number {
  let n = 0;
  for (const t of readdirSync('/proc/self/task')) {
    try {
      if (readFileSync(`/proc/self/task/${t}/comm`, 'utf8').trim() === 'vsock') n++;
    } catch {} // (a thread that ended meanwhile)
  }
  return n;
}

/** A park and a thread's end have no event of their own: asks again every 5 ms, up to 5 s. */
async function poll(cond: () => boolean, what: string): Promise<void> {
  const deadline = Date.now() + 5000;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function park(g: Guest): Promise<void> {
  g.d.device.requestPark();
  await poll(() => g.d.device.stats().parked, 'the loop to park').catch((e) => {
    throw new Error(`${e.message}: ${JSON.stringify(g.d.device.stats())}`);
  });
}

test('park: the loop thread ends until the host connects or writes; both are served as usual', () =>
  withGuest(async (g) => {
    assert.ok(g.d.device.sync(5000)); // (the loop thread has its name once it has run)
    const threads = vsockThreads();
    const watched = g.d.device.stats().parkWatched;
    await park(g);
    await poll(() => vsockThreads() === threads - 1, 'the loop thread to end');
    assert.is(g.d.device.stats().parks, 1);
    assert.is(g.d.device.stats().parkWatched, watched + 1, 'the park watch holds its epoll fd');
    const { host, hostPort } = await hostConnect(g, 1024);
    assert.not.ok(g.d.device.stats().parked);
    assert.ok(g.d.device.sync(5000));
    assert.is(vsockThreads(), threads, 'a loop thread again');
    assert.is(g.d.device.stats().parkWatched, watched);
    host.write('after the park');
    assert.is((await g.recv(isOp(OP.RW, hostPort), 'data after the park')).data.toString(), 'after the park');
    // With a connection open and idle it parks again; bytes from the host start it.
    await park(g);
    host.write('wake up');
    assert.is((await g.recv(isOp(OP.RW, hostPort), 'the bytes that woke it')).data.toString(), 'wake up');
    assert.is(g.d.device.stats().parks, 2);
    host.destroy();
  }));

test('park: a guest kick, a sync or a transport reset starts the loop again; pause, resume and reset of a parked loop', () =>
  withGuest(async (g) => {
    await park(g);
    g.send({ op: OP.RW, srcPort: 4400, dstPort: 99 }, Buffer.from('x')); // (to no connection: answered with RST)
    await g.recv(isOp(OP.RST), 'RST to a packet sent while parked');
    assert.not.ok(g.d.device.stats().parked);
    await park(g);
    assert.ok(g.d.device.sync(5000), 'sync of a parked loop');
    assert.not.ok(g.d.device.stats().parked, 'started for the sync');
    await park(g);
    g.d.device.transportReset();
    await g.resetEvent();
    // A hold (pause) of a parked loop keeps it stopped; resume starts it.
    await park(g);
    g.d.device.pause();
    assert.not.ok(g.d.device.stats().parked, 'held, not parked');
    g.send({ op: OP.RW, srcPort: 4401, dstPort: 99 }, Buffer.from('x'));
    const txBefore = g.d.device.stats().txPackets;
    assert.ok(g.d.device.sync(5000));
    assert.is(g.d.device.stats().txPackets, txBefore, 'nothing processed while held');
    g.d.device.resume();
    await g.recv(isOp(OP.RST), 'RST after resume');
    // The guest resets and activates the device while it is parked.
    await park(g);
    g.d.device.reset();
    g.activate();
    const { host, hostPort } = await hostConnect(g, 4402);
    host.destroy();
    await g.recv(isOp(OP.SHUTDOWN, hostPort), 'SHUTDOWN after the host closed');
    g.send({ op: OP.RST, srcPort: 4402, dstPort: hostPort });
    assert.ok(g.d.device.sync(5000));
    assert.is(g.d.device.stats().connections, 0);
    await park(g); // (and withGuest closes a parked device)
  }));

test('park: not while a connection waits for the guest to answer, and no pass for the refusal; a host close wakes it', () =>
  withGuest(async (g) => {
    const host = await connectHost(g.socketPath);
    host.write('CONNECT 1600\n');
    const req = await g.recv(isOp(OP.REQUEST), 'OP_REQUEST');
    assert.ok(g.d.device.sync(5000)); // (the kicks so far handled)
    // A packet in the tx ring without a kick: a pass would take it.
    g.tx.addChain([{ addr: g.d.buffer(HDR, encodeHdr({ srcCid: CID, dstCid: HOST_CID, srcPort: 4500, dstPort: 98, len: 0, type: 1, op: OP.RW, flags: 0, bufAlloc: 65536, fwdCnt: 0 })), len: HDR, write: false }]);
    const txBefore = g.d.device.stats().txPackets;
    g.d.device.requestPark();
    await poll(() => g.d.device.stats().parkRefusals === 1, 'the park to be refused');
    assert.not.ok(g.d.device.stats().parked, 'a connect deadline is pending');
    assert.is(g.d.device.stats().parks, 0);
    // Refused, the loop made no pass for it (for a packed VM, a pass writes its pages back).
    assert.is(g.d.device.stats().txPackets, txBefore, 'no pass for a refused park');
    assert.ok(g.d.device.sync(5000));
    assert.is(g.d.device.stats().txPackets, txBefore + 1, 'the next pass took the packet');
    await g.recv(isOp(OP.RST), 'RST to the packet to no connection');
    g.send({ op: OP.RESPONSE, srcPort: 1600, dstPort: req.hdr.srcPort });
    assert.is(await readLine(host), `OK ${req.hdr.srcPort}\n`);
    await park(g);
    host.destroy();
    const sd = await g.recv(isOp(OP.SHUTDOWN, req.hdr.srcPort), 'SHUTDOWN after the host closed');
    assert.is(sd.hdr.flags, SHUT_RCV | SHUT_SEND);
  }));

test('park: 100 cycles of park and wake, bytes both ways racing each park, none lost or reordered', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 4600);
    for (let i = 0; i < 100; i++) {
      g.d.device.requestPark();
      if (i % 3 === 0) await park(g); // (else the bytes below race the park)
      const msg = `message ${i}`;
      if (i % 2 === 0) {
        host.write(msg);
        assert.is((await g.recv(isOp(OP.RW, hostPort), `host bytes ${i}`)).data.toString(), msg);
      } else {
        g.send({ op: OP.RW, srcPort: 4600, dstPort: hostPort }, Buffer.from(msg));
        assert.is((await readBytes(host, msg.length)).toString(), msg);
      }
      if (i % 5 === 0) assert.ok(g.d.device.sync(5000), `sync ${i}`);
    }
    const s = g.d.device.stats();
    assert.ok(s.parks >= 34, `${s.parks} parks`);
    assert.is(s.connections, 1);
    assert.is(g.d.device.failure(), null);
    host.destroy();
  }));

test('snapshot: restoring from saved ring positions continues the rings and resets the transport', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 4300);
    g.send({ op: OP.RW, srcPort: 4300, dstPort: hostPort }, Buffer.from('before'));
    assert.is((await readBytes(host, 6)).toString(), 'before');
    g.settle();
    g.d.device.pause();
    const state = g.d.device.saveState();
    const txAtSnapshot = g.d.device.stats().txPackets;
    assert.is(state.active, true);
    assert.is(state.guestCid, CID);
    assert.is(state.driverFeatures, VIRTIO_F_VERSION_1 | VIRTIO_F_INDIRECT_DESC);
    assert.is(state.queues[1]!.lastAvail, 2, 'tx: RESPONSE and RW taken');
    assert.is(state.queues[1]!.nextUsed, 2);
    assert.is(state.queues[0]!.nextUsed, g.rx.usedIdx());
    assert.is(state.queues[1]!.desc, BigInt(g.tx.descAddr));
    // A packet posted after the snapshot point.
    g.send({ op: OP.RW, srcPort: 4300, dstPort: hostPort }, Buffer.from('after'));
    // The "child": a device restored from the state, without the connections.
    g.d.device.reset();
    await closed(host);
    g.d.device.restoreState(state);
    await g.resetEvent();
    // The post-snapshot packet is taken from where the rings stood: its
    // connection is gone, so it is answered with RST (and nothing older is replayed).
    await g.recv(isOp(OP.RST, hostPort), 'RST for the dropped connection');
    assert.is(g.d.device.stats().txPackets, txAtSnapshot + 1);
    const again = await hostConnect(g, 4301);
    again.host.write('restored');
    assert.is((await g.recv(isOp(OP.RW), 'data on the restored device')).data.toString(), 'restored');
    again.host.destroy();
    // A hostile saved state fails the device instead of trusting it.
    g.d.device.reset();
    g.d.device.restoreState({ ...state, queues: [state.queues[0]!, { ...state.queues[1]!, size: 3 }, state.queues[2]!] });
    assert.match(g.d.device.failure()!, /vsock tx queue: queue size 3 is not a power of two/);
  }));

// ---- hostile packets and chains ------------------------------------------------------------

test('malformed packets are dropped or reset, counted, and never fail the device', () =>
  withGuest(async (g) => {
    const { host, hostPort } = await hostConnect(g, 6000);
    const base = g.d.device.stats();
    // A tx chain shorter than a header.
    const short = g.d.buffer(20);
    g.tx.addChain([{ addr: short, len: 20, write: false }]);
    g.tx.kick();
    // Header says 100 bytes of payload, the chain has 10.
    g.send({ op: OP.RW, srcPort: 6000, dstPort: hostPort, len: 100 }, Buffer.alloc(10));
    await g.recv(isOp(OP.RST, hostPort), 'RST for a length beyond the buffer');
    await closed(host);
    // Not from our guest's CID / not to the host: silently dropped.
    g.send({ op: OP.REQUEST, srcCid: 99n, srcPort: 1, dstPort: 1 });
    g.send({ op: OP.REQUEST, dstCid: 5n, srcPort: 1, dstPort: 1 });
    g.send({ op: OP.REQUEST, srcCid: CID | (1n << 40n), srcPort: 1, dstPort: 1 });
    // Wrong type, unknown op, stray RW / SHUTDOWN / RESPONSE / CREDIT_UPDATE: RST.
    g.send({ op: OP.REQUEST, type: 2, srcPort: 10, dstPort: 11 });
    g.send({ op: 99, srcPort: 12, dstPort: 13 });
    g.send({ op: 0, srcPort: 14, dstPort: 15 });
    g.send({ op: OP.RW, srcPort: 16, dstPort: 17 }, Buffer.from('x'));
    g.send({ op: OP.SHUTDOWN, srcPort: 18, dstPort: 19, flags: 3 });
    g.send({ op: OP.RESPONSE, srcPort: 20, dstPort: 21 });
    g.send({ op: OP.CREDIT_UPDATE, srcPort: 22, dstPort: 23 });
    // A stray RST is not answered.
    g.send({ op: OP.RST, srcPort: 24, dstPort: 25 });
    // Payload over 64 KiB.
    g.send({ op: OP.RW, srcPort: 26, dstPort: 27 }, Buffer.alloc(65537));
    g.settle();
    const rsts = g.received.filter((p) => p.hdr.op === OP.RST).map((p) => p.hdr.dstPort);
    assert.equal(rsts.sort((a, b) => a - b), [10, 12, 14, 16, 18, 20, 22, 26]);
    for (const p of g.received) {
      assert.is(p.hdr.srcCid, HOST_CID);
      assert.is(p.hdr.dstCid, CID);
    }
    const s = g.d.device.stats();
    assert.is(s.txPackets - base.txPackets, 14);
    assert.ok(s.badPackets - base.badPackets >= 10, `bad packets counted (${s.badPackets - base.badPackets})`);
    assert.is(g.d.device.failure(), null);
  }));

test('an rx buffer too small for a header fails the device and closes host connections', () =>
  withGuest({ rxBuffers: 0 }, async (g) => {
    const tiny = g.d.buffer(20);
    g.rx.addChain([{ addr: tiny, len: 20, write: true }]);
    g.rx.kick();
    const host = await connectHost(g.socketPath);
    host.write('CONNECT 1\n');
    await g.d.until(() => g.d.failures.length > 0, 'the failure event');
    assert.match(g.d.device.failure()!, /vsock rx queue: buffer of 20 writable bytes is too small/);
    await closed(host);
    // A failed device refuses new host connections at once.
    const h2 = await connectHost(g.socketPath);
    await closed(h2);
  }));

test('a hostile tx chain fails the device; reset and re-activation recover it', () =>
  withGuest(async (g) => {
    const { host } = await hostConnect(g, 6100);
    g.tx.writeDesc(0, 0x8000, 44, DESC_F_NEXT, 0); // loop
    g.tx.publish(0);
    g.tx.kick();
    await g.d.until(() => g.d.failures.length > 0, 'the failure event');
    assert.match(g.d.device.failure()!, /vsock tx queue: descriptor chain from head 0 is longer than its table/);
    await closed(host);
    g.d.device.reset();
    assert.is(g.d.device.failure(), null);
    g.activate();
    const again = await hostConnect(g, 6101);
    again.host.write('alive');
    assert.is((await g.recv(isOp(OP.RW), 'data after recovery')).data.toString(), 'alive');
    again.host.destroy();
  }));

test('bad queue layouts fail activation (vsock)', () =>
  withGuest((g) => {
    g.d.device.reset();
    g.d.device.activate(
      [
        { size: 64, ready: true, desc: 0x1000, driver: 0x2000, device: 0x3000 },
        { size: 100, ready: true, desc: 0x5000, driver: 0x6000, device: 0x7000 },
        { size: 8, ready: true, desc: 0x9000, driver: 0xa000, device: 0xb000 },
      ],
      VIRTIO_F_VERSION_1,
    );
    assert.match(g.d.device.failure()!, /vsock tx queue: queue size 100 is not a power of two/);
    assert.ok(g.d.device.sync(1000), 'an inactive device syncs at once');
  }));

test('a stale socket file is replaced; a live one is refused', async () => {
  const path = sockPath();
  const { server } = await listen(path);
  try {
    assert.throws(() => new FakeDriver('vsock', { memorySize: 65536, guestCid: CID, socketPath: path }), /EADDRINUSE/);
  } finally {
    await new Promise<void>((r) => server.close(() => r()));
  }
  // A file left behind by a dead process (here: a socket nobody accepts on).
  const g1 = new FakeDriver('vsock', { memorySize: 65536, guestCid: CID, socketPath: path });
  g1.close();
  const g2 = new FakeDriver('vsock', { memorySize: 65536, guestCid: CID, socketPath: path });
  g2.close();
});

// ---- fuzz --------------------------------------------------------------------------

function prng(seed: number): () => number {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5;
    s >>>= 0;
    return s;
  };
}

test('fuzz: random vsock packets and tx chains (seeded, bounded)', async () => {
  const seed = Number(process.env.FUZZ_SEED ?? 0xf00d);
  const rand = prng(seed);
  const path = sockPath();
  const accepted: Socket[] = [];
  const server = createServer((s) => {
    s.on('data', () => {});
    s.on('error', () => {});
    accepted.push(s);
  });
  await new Promise<void>((r) => server.listen(`${path}_5000`, () => r()));
  const g = new Guest(path, { memorySize: 8 << 20 });
  const ports = [5000, 5001, 1024, 2 ** 30, 2 ** 30 + 1, 0, 0xffffffff];
  const pick = <T>(xs: readonly T[]): T => xs[rand() % xs.length]!;
  const deadline = Date.now() + 10_000;
  let iterations = 0;
  let failures = 0;
  try {
    while (iterations < 20_000 && Date.now() < deadline) {
      iterations++;
      if (g.d.mark > (7 << 20)) {
        // Out of fake-driver memory: start over with a fresh layout.
        g.d.device.reset();
        g.activate();
      }
      const r = rand() % 100;
      if (r < 85) {
        // A well-formed chain carrying a random header (mostly plausible).
        const payloadLen = rand() % 4 === 0 ? rand() % 300 : 0;
        const h: Partial<Hdr> = {
          srcCid: rand() % 20 === 0 ? BigInt(rand()) : CID,
          dstCid: rand() % 20 === 0 ? BigInt(rand()) : HOST_CID,
          srcPort: pick(ports) + (rand() % 3),
          dstPort: pick(ports),
          type: rand() % 10 === 0 ? rand() & 0xffff : 1,
          op: rand() % 10 === 0 ? rand() & 0xffff : rand() % 8,
          flags: rand() % 4,
          bufAlloc: rand() % 3 === 0 ? rand() : 65536,
          fwdCnt: rand(),
          len: rand() % 10 === 0 ? rand() : payloadLen,
        };
        g.send(h, payloadLen ? Buffer.alloc(payloadLen, rand() & 0xff) : undefined);
      } else if (r < 95) {
        // Random bytes as a packet.
        const n = 1 + (rand() % 80);
        const b = Buffer.alloc(n);
        for (let i = 0; i < n; i++) b[i] = rand() & 0xff;
        const at = g.d.buffer(n, b);
        g.tx.addChain([{ addr: at, len: n, write: false }]);
        g.tx.kick();
      } else {
        // A hostile descriptor: out of RAM, zero length or a loop.
        const head = g.tx.addChain([{ addr: g.d.buffer(44), len: 44, write: false }]);
        const kind = rand() % 3;
        if (kind === 0) g.tx.writeDesc(head, (BigInt(rand()) << 32n) | BigInt(rand()), 44, 0, 0);
        else if (kind === 1) g.tx.writeDesc(head, 0x8000, 0, 0, 0);
        else g.tx.writeDesc(head, 0x8000, 44, DESC_F_NEXT, head);
        g.tx.kick();
      }
      if (rand() % 50 === 0) g.d.device.transportReset();
      assert.ok(g.d.device.sync(5000), 'device loop answers');
      g.pump();
      g.received.length = 0;
      g.events.length = 0;
      const f = g.d.device.failure();
      if (f !== null) {
        failures++;
        assert.match(f, /^vsock (rx|tx|event) queue: /);
        g.d.device.reset();
        g.activate();
      }
    }
    const s = g.d.device.stats();
    assert.ok(iterations >= 1000, `ran ${iterations} iterations`);
    assert.ok(failures > 0, 'hostile chains failed the device');
    // The device still works end to end.
    g.d.device.reset();
    g.activate();
    const { host } = await hostConnect(g, 7000);
    host.write('after fuzz');
    assert.is((await g.recv(isOp(OP.RW), 'data after the fuzz')).data.toString(), 'after fuzz');
    host.destroy();
    console.log(
      `  vsock fuzz: seed ${seed}, ${iterations} iterations, ${failures} device failures, ${s.badPackets} bad packets, ${s.resetsSent} resets, ${accepted.length} guest connections bridged`,
    );
  } finally {
    g.close();
    for (const s of accepted) s.destroy();
    server.close();
  }
});

test.after(() => {
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test.run();
