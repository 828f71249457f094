// The metrics `forkling serve` exports at /metrics.
import { Counter, Gauge, Histogram, Registry } from './metrics.ts';

export class ServerMetrics {
  readonly registry = new Registry();
  readonly created = this.registry.add(
    new Counter('forkling_sandboxes_created_total', 'Sandboxes started, by how (create, fork, branch).'),
  );
  readonly ended = this.registry.add(
    new Counter('forkling_sandboxes_ended_total', 'Sandboxes ended, by reason (killed, timeout, shutdown, crashed, ...).'),
  );
  readonly forks = this.registry.add(new Counter('forkling_forks_total', 'Create and fork requests served.'));
  readonly branches = this.registry.add(new Counter('forkling_branches_total', 'Branch requests served.'));
  readonly spawnLatency = this.registry.add(
    new Histogram('forkling_spawn_duration_seconds', 'Time from request to ready sandboxes, by kind.'),
  );
  readonly requestLatency = this.registry.add(
    new Histogram(
      'forkling_request_duration_seconds',
      'Duration of answered requests, by operation and transport (ws, http).',
    ),
  );
  readonly errors = this.registry.add(
    new Counter('forkling_request_errors_total', 'Requests answered with an error, by code and transport.'),
  );
  readonly authFailures = this.registry.add(
    new Counter('forkling_auth_failures_total', 'Requests and upgrades refused for a missing or wrong token.'),
  );

  gauge(name: string, help: string, read: () => Array<[Record<string, string>, number]>): void {
    this.registry.add(new Gauge(name, help, read));
  }

  render(): string {
    return this.registry.render();
  }
}
