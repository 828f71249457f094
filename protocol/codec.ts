// Frame codec: msgpack (msgpackr) payloads, and the 4-byte big-endian length
// prefix used on byte streams (Unix socket, vsock). WebSocket carries one
// payload per binary message, without the prefix.
//
// Browser-safe: no node-only imports; the public API takes and returns
// Uint8Array (Node's Buffer is one).
import { C1, Packr, Unpackr } from 'msgpackr';
import { MAX_FRAME } from './schema.ts';

// msgpackr 2.x supports 'auto' at run time; its typings predate it.
const AUTO = 'auto' as unknown as 'number';
const packr = new Packr({
  // skipValues is supported at run time too, missing from the typings as well
  ...({ skipValues: [undefined] } as object),
  useRecords: false,
  mapsAsObjects: true,
  variableMapSize: true, // fixmap for small maps: compact, and what the Python side writes
  int64AsType: AUTO, // numbers where exact, bigint beyond 2^53
});
// structuredClone: false: msgpackr otherwise reads its own extensions 0x69/0x70
// (object ids and back-references), with which a peer builds a value that
// contains itself; such a value sent on would recurse without end.
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: AUTO, structuredClone: false });

/** Encodes one frame (a plain object) as a msgpack payload, without length prefix. */
export function encodeFrame(frame: object): Uint8Array {
  return packr.pack(wideInts(frame));
}

/**
 * msgpackr writes integers outside 32 bits as float64, which the Python side
 * would read as floats; as BigInt they are written as int64/uint64. Copies
 * only the containers that hold such an integer.
 */
function wideInts(x: unknown): unknown {
  if (typeof x === 'number') {
    return Number.isInteger(x) && (x > 0xffffffff || x < -0x80000000) ? BigInt(x) : x;
  }
  if (typeof x !== 'object' || x === null || x instanceof Uint8Array) return x;
  if (Array.isArray(x)) {
    let out: unknown[] | null = null;
    for (let i = 0; i < x.length; i++) {
      const v = wideInts(x[i]);
      if (v === x[i]) continue;
      out ??= [...x];
      out[i] = v;
    }
    return out ?? x;
  }
  let out: Record<string, unknown> | null = null;
  for (const k in x) {
    const v0 = (x as Record<string, unknown>)[k];
    const v = wideInts(v0);
    if (v === v0) continue;
    out ??= { ...(x as Record<string, unknown>) };
    out[k] = v;
  }
  return out ?? x;
}

/**
 * Deepest nesting of maps and arrays a frame may have (the frame's own map
 * counts as 1). Deeper values would decode here but not encode again (both
 * recurse): a server passing a sandbox's answer on would fail.
 */
export const MAX_NESTING = 128;
/**
 * Most maps and arrays, and most values of any kind, in one frame. What a
 * frame of 16 MiB could otherwise hold (16 Mi one-byte empty maps) took 10 s
 * and 2 GiB of heap to decode, stalling every session; at these limits the
 * worst frame decodes in about 0.1 s. The largest honest frames are far
 * below: an eval's value is at most 100 000 items.
 */
export const MAX_CONTAINERS = 1 << 18;
export const MAX_ITEMS = 1 << 21;

/**
 * Walks a msgpack payload's headers without building anything, and throws
 * before a decode would cost more than the limits allow: nesting beyond
 * MAX_NESTING, more than MAX_CONTAINERS maps and arrays or MAX_ITEMS values,
 * a container that announces more values than bytes are left. Malformed or
 * truncated bytes are left to the decoder.
 */
function checkShape(b: Uint8Array): void {
  const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
  const len = b.length;
  const open: number[] = []; // values still to come in each open container
  let pos = 0;
  let items = 0;
  let containers = 0;
  while (pos < len) {
    const t = b[pos]!;
    let head = 1; // header bytes
    let skip = 0; // payload bytes after the header (str, bin, ext, numbers)
    let count = -1; // values in a container (a map's keys and values), -1: not a container
    if (t <= 0x7f || t >= 0xe0 || t === 0xc0 || t === 0xc2 || t === 0xc3) {
      // fixint, nil, bool
    } else if (t <= 0x8f) count = (t & 0x0f) * 2;
    else if (t <= 0x9f) count = t & 0x0f;
    else if (t <= 0xbf) skip = t & 0x1f;
    else {
      const need = (n: number) => pos + n < len;
      switch (t) {
        case 0xc4:
        case 0xd9:
          if (!need(1)) return;
          head = 2;
          skip = b[pos + 1]!;
          break;
        case 0xc5:
        case 0xda:
          if (!need(2)) return;
          head = 3;
          skip = view.getUint16(pos + 1);
          break;
        case 0xc6:
        case 0xdb:
          if (!need(4)) return;
          head = 5;
          skip = view.getUint32(pos + 1);
          break;
        case 0xc7:
          if (!need(1)) return;
          head = 3;
          skip = b[pos + 1]!;
          break;
        case 0xc8:
          if (!need(2)) return;
          head = 4;
          skip = view.getUint16(pos + 1);
          break;
        case 0xc9:
          if (!need(4)) return;
          head = 6;
          skip = view.getUint32(pos + 1);
          break;
        case 0xca:
        case 0xce:
        case 0xd2:
          skip = 4;
          break;
        case 0xcb:
        case 0xcf:
        case 0xd3:
          skip = 8;
          break;
        case 0xcc:
        case 0xd0:
          skip = 1;
          break;
        case 0xcd:
        case 0xd1:
          skip = 2;
          break;
        case 0xd4:
          skip = 2;
          break;
        case 0xd5:
          skip = 3;
          break;
        case 0xd6:
          skip = 5;
          break;
        case 0xd7:
          skip = 9;
          break;
        case 0xd8:
          skip = 17;
          break;
        case 0xdc:
          if (!need(2)) return;
          head = 3;
          count = view.getUint16(pos + 1);
          break;
        case 0xdd:
          if (!need(4)) return;
          head = 5;
          count = view.getUint32(pos + 1);
          break;
        case 0xde:
          if (!need(2)) return;
          head = 3;
          count = view.getUint16(pos + 1) * 2;
          break;
        case 0xdf:
          if (!need(4)) return;
          head = 5;
          count = view.getUint32(pos + 1) * 2;
          break;
        default:
          return; // 0xc1: the decoder says so
      }
    }
    pos += head + skip;
    if (++items > MAX_ITEMS) throw new Error(`more than ${MAX_ITEMS} values in one frame`);
    if (open.length) open[open.length - 1]!--;
    if (count >= 0) {
      if (open.length + 1 > MAX_NESTING) throw new Error(`maps and arrays nested deeper than ${MAX_NESTING}`);
      if (++containers > MAX_CONTAINERS) throw new Error(`more than ${MAX_CONTAINERS} maps and arrays in one frame`);
      if (count > len - pos) throw new Error(`a map or array announces ${count} values, more than the frame's bytes left`);
      if (count > 0) open.push(count);
    }
    while (open.length && open[open.length - 1] === 0) open.pop();
  }
}

/**
 * Decodes one msgpack payload. Throws on malformed msgpack, trailing bytes,
 * nesting deeper than MAX_NESTING, or more values than MAX_CONTAINERS / MAX_ITEMS
 * (checked before anything is built).
 */
export function decodeFrame(payload: Uint8Array): unknown {
  checkShape(payload);
  const values = unpackr.unpackMultiple(payload) as unknown[];
  if (values.length !== 1) throw new Error(`expected one msgpack value, found ${values.length}`);
  // msgpackr returns a marker for the never-used byte 0xc1 instead of failing
  if (values[0] === C1) throw new Error('byte 0xc1 is not valid msgpack');
  return values[0];
}

/** The 4-byte big-endian length prefix for a payload of `length` bytes. */
export function lengthPrefix(length: number): Uint8Array {
  const p = new Uint8Array(4);
  new DataView(p.buffer).setUint32(0, length);
  return p;
}

/** Length prefix + payload in one buffer (for tests and small frames). */
export function encodePrefixed(frame: object): Uint8Array {
  const payload = encodeFrame(frame);
  const out = new Uint8Array(4 + payload.length);
  out.set(lengthPrefix(payload.length), 0);
  out.set(payload, 4);
  return out;
}

export interface FrameReaderHandlers {
  /** One complete payload (not yet decoded). */
  payload(bytes: Uint8Array): void;
  /** A prefix announced more than maxFrame bytes; that many bytes are being skipped. */
  oversize(length: number): void;
}

/**
 * Splits a byte stream into length-prefixed payloads. Oversized frames are
 * skipped (their bytes discarded) so the stream stays in step; the caller
 * decides what to report.
 */
export class FrameReader {
  private chunks: Uint8Array[] = [];
  private buffered = 0;
  private need = -1; // payload length of the frame being read; -1: reading a prefix
  private skip = 0; // bytes of an oversized frame still to discard

  constructor(
    private readonly handlers: FrameReaderHandlers,
    private readonly maxFrame = MAX_FRAME,
  ) {}

  push(chunk: Uint8Array): void {
    if (this.skip > 0) {
      const n = Math.min(this.skip, chunk.length);
      this.skip -= n;
      chunk = chunk.subarray(n);
    }
    if (chunk.length === 0) return;
    this.chunks.push(chunk);
    this.buffered += chunk.length;
    for (;;) {
      if (this.need < 0) {
        if (this.buffered < 4) return;
        const head = this.take(4);
        const length = new DataView(head.buffer, head.byteOffset, 4).getUint32(0);
        if (length > this.maxFrame) {
          const n = Math.min(length, this.buffered);
          this.take(n);
          this.skip = length - n;
          this.handlers.oversize(length);
          continue;
        }
        this.need = length;
      }
      if (this.buffered < this.need) return;
      const payload = this.take(this.need);
      this.need = -1;
      this.handlers.payload(payload);
    }
  }

  /** Bytes held for an incomplete frame. */
  get pending(): number {
    return this.buffered;
  }

  private take(n: number): Uint8Array {
    const first = this.chunks[0];
    if (first && first.length >= n) {
      const out = first.subarray(0, n);
      if (first.length === n) this.chunks.shift();
      else this.chunks[0] = first.subarray(n);
      this.buffered -= n;
      return out;
    }
    const out = new Uint8Array(n);
    let off = 0;
    let i = 0; // chunks fully used; removed at once (shift() per chunk is quadratic)
    while (off < n) {
      const c = this.chunks[i]!;
      const k = Math.min(c.length, n - off);
      out.set(c.subarray(0, k), off);
      off += k;
      if (k === c.length) i++;
      else this.chunks[i] = c.subarray(k);
    }
    this.chunks.splice(0, i);
    this.buffered -= n;
    return out;
  }
}

/** Hex of bytes (golden vectors, diagnostics). */
export function toHex(bytes: Uint8Array): string {
  let s = '';
  for (const b of bytes) s += b.toString(16).padStart(2, '0');
  return s;
}

export function fromHex(hex: string): Uint8Array {
  if (hex.length % 2 !== 0 || /[^0-9a-f]/i.test(hex)) throw new Error('invalid hex');
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = Number.parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

/** Joins byte chunks into one array (browser-safe; no Buffer). */
export function concat(parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let off = 0;
  for (const p of parts) {
    out.set(p, off);
    off += p.length;
  }
  return out;
}
