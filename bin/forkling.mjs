#!/usr/bin/env node
// The `forkling` command. The host is TypeScript run through tsx (no build step).
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../host/cli/main.ts');
process.exitCode = await main(process.argv.slice(2));
