// Bytes the server holds for clients that have not read them yet, over all
// WebSocket sessions and streamed HTTP responses (outlets). Three rules, each
// ending an outlet (its requests cancelled) through the callback it was opened
// with:
// - one outlet holds at most MAX_OUTLET;
// - all of them together hold at most the server's budget
//   (`--max-unsent-mib`; without it, N slow clients could make the server hold
//   N times MAX_OUTLET): past it, the outlets holding the most are cut until
//   the rest fit;
// - an outlet of at least CUT_MIN of which no byte has gone out for STALL_MS
//   is cut (a client that stopped reading, or an answer that ended and sits
//   unread: it would otherwise hold its bytes for good).
// A client that keeps up holds less than CUT_MIN and is never cut.

/** What one outlet may hold unsent, whatever the budget. */
export const MAX_OUTLET = 256 * 1024 * 1024;
/** An outlet holding less is never cut (a client that keeps up holds about a frame). */
export const CUT_MIN = 64 * 1024;
/** Default budget: 1 GiB. */
export const DEFAULT_MAX_UNSENT = 1024 * 1024 * 1024;
/** Default time an outlet of CUT_MIN or more may send nothing. */
export const STALL_MS = 60_000;
/** While over budget, outlets are read again at most this often (each read visits every outlet). */
const REFRESH_MS = 20;

const MiB = (n: number) => `${Math.round(n / 2 ** 20)} MiB`;

export class UnsentBudget {
  private readonly outlets = new Set<Outlet>();
  /** Sum of what each outlet held when last read (they drain in between: high until refreshed). */
  total = 0;
  private refreshedAt = -Infinity;
  private sweeper: ReturnType<typeof setInterval> | undefined;
  readonly stallMs: number;
  private readonly refreshMs: number;

  constructor(
    readonly limit = DEFAULT_MAX_UNSENT,
    opts: { stallMs?: number; refreshMs?: number } = {},
  ) {
    if (!(Number.isSafeInteger(limit) && limit > 0)) throw new RangeError(`unsent budget ${limit}: a positive number of bytes`);
    this.stallMs = opts.stallMs ?? STALL_MS;
    this.refreshMs = opts.refreshMs ?? REFRESH_MS;
  }

  /**
   * An outlet whose unsent bytes `unsent()` tells (a socket's buffered amount);
   * `cut(why)` ends it (it is already closed here when that is called).
   */
  open(unsent: () => number, cut: (why: string) => void): Outlet {
    const o = new Outlet(this, unsent, cut);
    this.outlets.add(o);
    this.sweeper ??= setInterval(() => this.sweep(), Math.max(10, Math.min(5000, this.stallMs / 4)));
    this.sweeper.unref?.();
    return o;
  }

  /** @internal */
  forget(o: Outlet): void {
    this.outlets.delete(o);
    if (this.outlets.size === 0) {
      clearInterval(this.sweeper);
      this.sweeper = undefined;
    }
  }

  /** Reads every outlet again (at most every refreshMs): whether it did. */
  private refresh(now = performance.now()): boolean {
    if (now - this.refreshedAt < this.refreshMs) return false;
    this.refreshedAt = now;
    let total = 0;
    for (const o of this.outlets) total += o.read();
    this.total = total;
    return true;
  }

  /** @internal After `o` was written to: the rules above. */
  check(o: Outlet): void {
    if (o.held > MAX_OUTLET) {
      o.cutFor(`more than ${MiB(MAX_OUTLET)} unsent to this client`);
      return;
    }
    // Cut only on fresh figures (outlets drain between their writes); until the
    // next refresh the server may go over by what it is sent meanwhile.
    if (this.total <= this.limit || !this.refresh()) return;
    while (this.total > this.limit) {
      let big: Outlet | null = null;
      for (const x of this.outlets) if (x.held >= CUT_MIN && (!big || x.held > big.held)) big = x;
      if (!big) return;
      big.cutFor(`the server holds more than its budget of ${MiB(this.limit)} unsent to clients (--max-unsent-mib), ${MiB(big.held)} of it for this client, the most`);
    }
  }

  /** Outlets of CUT_MIN or more that sent nothing for stallMs are cut. */
  private sweep(): void {
    const now = performance.now();
    let total = 0;
    for (const o of [...this.outlets]) {
      const held = o.read();
      const sent = o.written - held;
      if (held < CUT_MIN || sent > o.sentAtSweep) o.progressAt = now;
      o.sentAtSweep = sent;
      if (now - o.progressAt > this.stallMs) o.cutFor(`no byte of the ${MiB(held)} unsent to this client went out for ${this.stallMs / 1000} s`);
      else total += held;
    }
    this.total = total;
    this.refreshedAt = now;
  }
}

export class Outlet {
  /** What it held when last read. */
  held = 0;
  /** Bytes written to it in all. */
  written = 0;
  /** @internal sweep(): bytes gone out at the last sweep, and when some last went. */
  sentAtSweep = 0;
  progressAt = performance.now();
  private closed = false;

  constructor(
    private readonly budget: UnsentBudget,
    private readonly unsent: () => number,
    private readonly onCut: (why: string) => void,
  ) {}

  /** @internal Reads what it holds now (the caller keeps the budget's total). */
  read(): number {
    this.held = this.closed ? 0 : this.unsent();
    return this.held;
  }

  /** After writing `bytes` to it: the budget's rules (this or other outlets may be cut). */
  wrote(bytes: number): void {
    if (this.closed) return;
    this.written += bytes;
    const before = this.held;
    this.budget.total += this.read() - before;
    this.budget.check(this);
  }

  /** @internal Closes it and ends it through its callback. */
  cutFor(why: string): void {
    if (this.closed) return;
    this.close();
    this.onCut(why);
  }

  /** The outlet is gone (or going): what it held no longer counts. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.budget.total -= this.held;
    this.held = 0;
    this.budget.forget(this);
  }
}
