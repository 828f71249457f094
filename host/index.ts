// The package entry (`import { Sandbox } from 'forkling'`) for Node.js. The
// same API without Node glue is in host/sdk/browser.ts.
import './sdk/node.ts';

export * from './sdk/browser.ts';
