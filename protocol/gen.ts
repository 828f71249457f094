// Writes the schema (protocol/schema.ts) as JSON Schema to protocol/schema.json
// and embeds the same document in guest-agent/forkling_agent.py (between the
// GENERATED SCHEMA markers), so the agent stays one file. The protocol tests
// fail when either copy is stale: run `npx tsx protocol/gen.ts` after editing
// the schema.
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { schemaDocument } from './schema.ts';

const root = dirname(dirname(fileURLToPath(import.meta.url)));
export const SCHEMA_JSON_PATH = join(root, 'protocol', 'schema.json');
export const AGENT_PATH = join(root, 'guest-agent', 'forkling_agent.py');
const BEGIN = '# --- BEGIN GENERATED SCHEMA (protocol/gen.ts; do not edit) ---';
const END = '# --- END GENERATED SCHEMA ---';

export function schemaJson(): string {
  return `${JSON.stringify(schemaDocument(), null, 1)}\n`;
}

/** The agent source with its embedded schema replaced by the current one. */
export function agentWithSchema(source: string): string {
  const a = source.indexOf(BEGIN);
  const b = source.indexOf(END);
  if (a < 0 || b < a) throw new Error(`${AGENT_PATH}: schema markers not found`);
  // A JSON string literal is also a valid Python string literal (ASCII only here).
  const literal = JSON.stringify(JSON.stringify(schemaDocument()));
  return `${source.slice(0, a)}${BEGIN}\nSCHEMA_JSON = ${literal}\n${source.slice(b)}`;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  writeFileSync(SCHEMA_JSON_PATH, schemaJson());
  writeFileSync(AGENT_PATH, agentWithSchema(readFileSync(AGENT_PATH, 'utf8')));
  console.log(`wrote ${SCHEMA_JSON_PATH} and the schema in ${AGENT_PATH}`);
}
