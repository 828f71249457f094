// The one interface behind which both engines (kvm, process) sit. The sandbox
// manager, the CLI and the server only ever see these types.
import type { AgentClient } from '../agent/client.ts';

export type EngineName = 'kvm' | 'process';

export interface BootOptions {
  /** Image name in the store (built on first use when it is 'default'). */
  image: string;
  memoryMiB?: number;
  vcpus?: number;
  /** Called with each console line of the guest as it arrives. */
  onConsole?: (line: string) => void;
  /** Overall limit until the agent answers hello. */
  readyTimeoutMs?: number;
}

export interface TemplateOptions {
  name: string;
  image: string;
  warmup?: string;
  /** Limit of the warm-up (default DEFAULT_WARMUP_TIMEOUT_MS, warmup.ts). */
  warmupTimeoutMs?: number;
  memoryMiB?: number;
  vcpus?: number;
}

export interface TemplateInfo {
  name: string;
  engine: EngineName;
  image: string;
  createdAt: string;
  memoryMiB: number;
  vcpus: number;
  warmup?: string;
  /** The warm-up's limit when one was given (else the default); a process template runs its warm-up, under it, at each start of its zygote. */
  warmupTimeoutMs?: number;
}

export interface SandboxStats {
  /** Private memory of this sandbox in KiB while it is alive (pages it owns alone). */
  privateKiB: number;
  /** Engine-specific counters (e.g. VM exits by kind). */
  counters: Record<string, number>;
}

export interface ExitInfo {
  reason: 'poweroff' | 'reset' | 'killed' | 'crashed' | 'triple-fault' | 'internal-error' | 'timeout';
  message?: string;
}

export interface Sandbox {
  readonly id: string;
  readonly engine: EngineName;
  /** The agent in this sandbox; connected and past `restore` when handed out. */
  readonly agent: AgentClient;
  /**
   * performance.now() when its creation began and when it became ready (its
   * agent answered: hello for a boot, restore for a fork or branch child).
   * Figures are measured from these, never from when an API call returned.
   */
  readonly timings: { startedAt: number; readyAt: number };
  /** Recent console lines (bounded). */
  readonly console: readonly string[];
  /** Resolves once the sandbox has ended, for whatever reason. */
  readonly exited: Promise<ExitInfo>;
  pause(): Promise<void>;
  resume(): Promise<void>;
  kill(): Promise<void>;
  stats(): Promise<SandboxStats>;
}

export interface Engine {
  readonly name: EngineName;
  /** One line for people: what isolates sandboxes on this engine. */
  readonly isolation: string;
  /** Cold boot of an image to a ready agent. */
  boot(opts: BootOptions): Promise<Sandbox>;
  /** Boots, warms up and freezes a template. */
  createTemplate(opts: TemplateOptions): Promise<TemplateInfo>;
  /**
   * Makes a template ready to fork at once (fork does this itself when needed):
   * the process engine starts its zygote, the KVM engine checks its files; the
   * template `default` is created on first use. Once per template and engine.
   */
  prepare(template: string): Promise<void>;
  /** n children of a template, each ready (restore done) when resolved. */
  fork(template: string, n: number): Promise<Sandbox[]>;
  /** n children continuing from the live state of a running sandbox; the source goes on. */
  branch(source: Sandbox, n: number): Promise<Sandbox[]>;
  /** Frees everything the engine holds (kills its sandboxes). */
  close(): Promise<void>;
}
