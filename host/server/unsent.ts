// Bytes the server holds for clients that have not read them yet, over all
// WebSocket sessions and streamed HTTP responses. Each outlet has a cap of its
// own (MAX_OUTLET); all of them together have the server's budget
// (`--max-unsent-mib`): without it, N slow clients could make the server hold
// N times an outlet's cap. Past the budget, an outlet that holds at least
// CUT_MIN and writes more is cut (its requests cancelled), so the clients
// that hold the most go first and those that keep up are not touched.

/** What one outlet may hold unsent, whatever the budget. */
export const MAX_OUTLET = 256 * 1024 * 1024;
/** An outlet holding less is never cut for the budget (a client that reads). */
export const CUT_MIN = 1024 * 1024;
/** Default budget: 1 GiB. */
export const DEFAULT_MAX_UNSENT = 1024 * 1024 * 1024;
/** While over budget, outlets are read again at most this often (each read visits every outlet). */
const REFRESH_MS = 20;

export class UnsentBudget {
  private readonly outlets = new Set<Outlet>();
  /** Sum of what each outlet held at its last write (they drain in between: high until refreshed). */
  total = 0;
  private refreshedAt = -Infinity;

  constructor(readonly limit = DEFAULT_MAX_UNSENT) {
    if (!(Number.isSafeInteger(limit) && limit > 0)) throw new RangeError(`unsent budget ${limit}: a positive number of bytes`);
  }

  /** An outlet whose unsent bytes `unsent()` tells (a socket's buffered amount). */
  open(unsent: () => number): Outlet {
    const o = new Outlet(this, unsent);
    this.outlets.add(o);
    return o;
  }

  /** @internal */
  forget(o: Outlet): void {
    this.outlets.delete(o);
  }

  /** Reads every outlet again (rate-limited): what they hold now. */
  refresh(now = performance.now()): void {
    if (now - this.refreshedAt < REFRESH_MS) return;
    this.refreshedAt = now;
    let total = 0;
    for (const o of this.outlets) total += o.read();
    this.total = total;
  }
}

export class Outlet {
  private held = 0;
  private closed = false;

  constructor(
    private readonly budget: UnsentBudget,
    private readonly unsent: () => number,
  ) {}

  /** @internal Reads what it holds now (without the budget's bookkeeping: refresh() sums). */
  read(): number {
    this.held = this.closed ? 0 : this.unsent();
    return this.held;
  }

  /**
   * After a write: null, or why to cut this outlet (it holds more than
   * MAX_OUTLET, or the server is over its budget and this outlet holds at
   * least CUT_MIN). The caller cuts it and then calls close().
   */
  wrote(): string | null {
    if (this.closed) return null;
    const before = this.held;
    this.budget.total += this.read() - before;
    if (this.held > MAX_OUTLET) return `more than ${MAX_OUTLET / 2 ** 20} MiB unsent to this client`;
    if (this.budget.total <= this.budget.limit || this.held < CUT_MIN) return null;
    this.budget.refresh();
    if (this.budget.total <= this.budget.limit) return null;
    return `the server holds more than its budget of ${Math.round(this.budget.limit / 2 ** 20)} MiB unsent to clients (--max-unsent-mib), ${Math.round(this.held / 2 ** 20)} MiB of it for this client`;
  }

  /** The outlet is gone: what it held no longer counts. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.budget.total -= this.held;
    this.held = 0;
    this.budget.forget(this);
  }
}
