// The OpenAPI 3.1 document served at /v1/openapi.json, generated from the
// TypeBox schemas (protocol/schema.ts, protocol/server-ops.ts), which are JSON
// Schema already; only msgpack byte strings change: in JSON they are base64
// strings (`format: byte`).
import type { TSchema } from '@sinclair/typebox';
import { ERROR_CODES, MAX_CHUNK, OPS } from '../../protocol/schema.ts';
import { ROUTED_OPS, SERVER_ERROR_CODES, SERVER_OPS, SandboxInfoSchema } from '../../protocol/server-ops.ts';

type Json = Record<string, unknown>;

/** A TypeBox schema as plain JSON Schema, with byte strings as base64 strings. */
export function jsonSchema(schema: TSchema): Json {
  return convert(JSON.parse(JSON.stringify(schema))) as Json;
}

function convert(x: unknown): unknown {
  if (Array.isArray(x)) return x.map(convert);
  if (typeof x !== 'object' || x === null) return x;
  const o = x as Json;
  if (o.type === 'Uint8Array') {
    const out: Json = { type: 'string', format: 'byte', contentEncoding: 'base64' };
    if (typeof o.maxByteLength === 'number') out.maxLength = Math.ceil(o.maxByteLength / 3) * 4;
    return out;
  }
  const out: Json = {};
  for (const [k, v] of Object.entries(o)) out[k] = convert(v);
  return out;
}

const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });

const errorResponse = (description: string) => ({
  description,
  content: { 'application/json': { schema: ref('Error') } },
});

const STD_ERRORS = {
  '400': errorResponse('Bad request: a field failed validation (the message names it).'),
  '401': errorResponse('Missing or wrong bearer token.'),
  '404': errorResponse('No such sandbox (or file, process).'),
  '410': errorResponse('The sandbox has ended (timeout, kill, crash); the message says why.'),
  '405': errorResponse('Method not allowed on this path.'),
  '413': errorResponse('Body too large.'),
  '429': errorResponse('Too many open requests.'),
  '500': errorResponse('Internal error (logged by the server).'),
  '503': errorResponse(
    'The server cannot take more sandboxes now, or is shutting down; or (resource_exhausted) an operation\'s events exceed 16 MiB, more than one JSON answer holds: stream them as NDJSON.',
  ),
};

const jsonBody = (schema: Json) => ({ required: true, content: { 'application/json': { schema } } });
const okJson = (schema: Json, description = 'OK') => ({
  description,
  content: { 'application/json': { schema } },
});

const SandboxIdParam = {
  name: 'id',
  in: 'path',
  required: true,
  schema: { type: 'string', pattern: '^[A-Za-z0-9._-]+$', maxLength: 128 },
};

function withoutSandbox(schema: TSchema): Json {
  return withoutKey(schema, 'sandbox');
}

/** The object schema without one property (it comes from the path instead). */
function withoutKey(schema: TSchema, key: string): Json {
  const s = jsonSchema(schema);
  const props = { ...(s.properties as Json) };
  delete props[key];
  const required = ((s.required as string[] | undefined) ?? []).filter((r) => r !== key);
  const out: Json = { ...s, properties: props };
  if (required.length) out.required = required;
  else delete out.required;
  return out;
}

function eventSchemas(op: (typeof ROUTED_OPS)[number]): Json[] {
  return Object.entries(OPS[op].events as Record<string, TSchema>).map(([name, schema]) => {
    const s = jsonSchema(schema);
    return {
      ...s,
      properties: { ev: { const: name, type: 'string' }, ...(s.properties as Json) },
      required: ['ev', ...((s.required as string[] | undefined) ?? [])],
    };
  });
}

function routedPath(op: (typeof ROUTED_OPS)[number]): Json {
  const def = OPS[op];
  const events = eventSchemas(op);
  const result = jsonSchema(def.result);
  const content: Json = {};
  if (events.length > 0) {
    content['application/json'] = {
      schema: {
        ...result,
        properties: { ...(result.properties as Json), events: { type: 'array', items: { anyOf: events } } },
        required: [...((result.required as string[] | undefined) ?? []), 'events'],
      },
    };
    content['application/x-ndjson'] = {
      schema: {
        description:
          'One JSON value per line: each stream event as it happens, then {"result": ...} or {"error": {...}} last.',
        anyOf: [
          ...events,
          { type: 'object', properties: { result: result }, required: ['result'] },
          { type: 'object', properties: { error: ref('ErrorBody') }, required: ['error'] },
        ],
      },
    };
  } else {
    content['application/json'] = { schema: result };
  }
  return {
    post: {
      operationId: op.replace(/\.(\w)/g, (_m, c: string) => c.toUpperCase()),
      summary: `Agent operation ${op} in the sandbox (see PROTOCOL.md)`,
      description:
        (events.length > 0
          ? 'Streams its events as NDJSON when the request has `Accept: application/x-ndjson`; otherwise the events come collected in `events`, up to 16 MiB of them (beyond: 503 resource_exhausted). '
          : '') + 'Byte fields are base64 strings in JSON.',
      parameters: [SandboxIdParam],
      requestBody: jsonBody(withoutSandbox(def.args)),
      responses: { '200': { description: 'OK', content }, ...STD_ERRORS },
    },
  };
}

export function buildOpenApi(version = '1'): Json {
  const sandboxOne = { type: 'object', properties: { sandbox: ref('SandboxInfo') }, required: ['sandbox'] };
  const sandboxMany = {
    type: 'object',
    properties: { sandboxes: { type: 'array', items: ref('SandboxInfo') } },
    required: ['sandboxes'],
  };
  const paths: Json = {
    '/healthz': {
      get: {
        operationId: 'health',
        summary: 'Liveness (no token needed)',
        responses: {
          '200': okJson({
            type: 'object',
            properties: { ok: { type: 'boolean' }, sandboxes: { type: 'integer' }, draining: { type: 'boolean' } },
            required: ['ok', 'sandboxes', 'draining'],
          }),
          '503': okJson({ type: 'object' }, 'Draining for shutdown'),
        },
      },
    },
    '/metrics': {
      get: {
        operationId: 'metrics',
        summary: 'Prometheus metrics (text format 0.0.4)',
        responses: { '200': { description: 'OK', content: { 'text/plain': { schema: { type: 'string' } } } } },
      },
    },
    '/v1/openapi.json': {
      get: {
        operationId: 'openapi',
        summary: 'This document',
        responses: { '200': okJson({ type: 'object' }) },
      },
    },
    '/v1/sandboxes': {
      get: {
        operationId: 'listSandboxes',
        responses: { '200': okJson(sandboxMany), ...STD_ERRORS },
      },
      post: {
        operationId: 'createSandbox',
        summary: 'Start a sandbox from a template (default: "default")',
        requestBody: jsonBody(jsonSchema(SERVER_OPS['sandbox.create'].args)),
        responses: { '201': okJson(sandboxOne, 'Created'), ...STD_ERRORS },
      },
    },
    '/v1/sandboxes/{id}': {
      get: {
        operationId: 'getSandbox',
        summary: 'The sandbox (connect to it)',
        parameters: [SandboxIdParam],
        responses: { '200': okJson(sandboxOne), ...STD_ERRORS },
      },
      delete: {
        operationId: 'killSandbox',
        parameters: [SandboxIdParam],
        responses: {
          '200': okJson({ type: 'object', properties: { killed: { type: 'boolean' } }, required: ['killed'] }),
          ...STD_ERRORS,
        },
      },
    },
    '/v1/sandboxes/{id}/timeout': {
      post: {
        operationId: 'setSandboxTimeout',
        summary: 'Set the timeout from now (extends or shortens)',
        parameters: [SandboxIdParam],
        requestBody: jsonBody(withoutSandbox(SERVER_OPS['sandbox.setTimeout'].args)),
        responses: { '200': okJson(sandboxOne), ...STD_ERRORS },
      },
    },
    '/v1/sandboxes/{id}/branch': {
      post: {
        operationId: 'branchSandbox',
        summary: 'n children continuing from the live state of the sandbox; the source goes on',
        parameters: [SandboxIdParam],
        requestBody: jsonBody(withoutSandbox(SERVER_OPS['sandbox.branch'].args)),
        responses: { '200': okJson(sandboxMany), ...STD_ERRORS },
      },
    },
    '/v1/sandboxes/{id}/stats': {
      get: {
        operationId: 'sandboxStats',
        parameters: [SandboxIdParam],
        responses: { '200': okJson(jsonSchema(SERVER_OPS['sandbox.stats'].result)), ...STD_ERRORS },
      },
    },
    '/v1/templates/{template}/fork': {
      post: {
        operationId: 'forkTemplate',
        summary: 'n new sandboxes from a template',
        parameters: [
          { name: 'template', in: 'path', required: true, schema: { type: 'string', pattern: '^[A-Za-z0-9._-]+$' } },
        ],
        requestBody: jsonBody({
          type: 'object',
          properties: {
            n: (jsonSchema(SERVER_OPS['sandbox.fork'].args).properties as Json).n,
            timeoutMs: (jsonSchema(SERVER_OPS['sandbox.fork'].args).properties as Json).timeoutMs,
          },
          required: ['n'],
        }),
        responses: { '200': okJson(sandboxMany), ...STD_ERRORS },
      },
    },
    '/v1/images/{image}/boot': {
      post: {
        operationId: 'bootImage',
        summary: 'Cold-boot a sandbox from an image (no template; slower than a fork)',
        parameters: [
          { name: 'image', in: 'path', required: true, schema: { type: 'string', pattern: '^[A-Za-z0-9._-]+$' } },
        ],
        requestBody: jsonBody(withoutKey(SERVER_OPS['sandbox.boot'].args, 'image')),
        responses: { '201': okJson(sandboxOne, 'Created'), ...STD_ERRORS },
      },
    },
    '/v1/sandboxes/{id}/files': {
      get: {
        operationId: 'readFileRaw',
        summary: `A file's bytes, streamed (chunks of up to ${MAX_CHUNK} bytes from the agent)`,
        parameters: [
          SandboxIdParam,
          { name: 'path', in: 'query', required: true, schema: { type: 'string' } },
          { name: 'offset', in: 'query', schema: { type: 'integer', minimum: 0 } },
          { name: 'length', in: 'query', schema: { type: 'integer', minimum: 0 } },
        ],
        responses: {
          '200': { description: 'The bytes', content: { 'application/octet-stream': { schema: { type: 'string' } } } },
          ...STD_ERRORS,
        },
      },
      put: {
        operationId: 'writeFileRaw',
        summary: 'Write the request body to a file (streamed), creating parent directories',
        parameters: [
          SandboxIdParam,
          { name: 'path', in: 'query', required: true, schema: { type: 'string' } },
          { name: 'append', in: 'query', schema: { type: 'boolean' } },
          { name: 'mode', in: 'query', schema: { type: 'string', pattern: '^[0-7]{1,4}$' }, description: 'octal' },
        ],
        requestBody: { required: true, content: { 'application/octet-stream': { schema: { type: 'string' } } } },
        responses: { '200': okJson(jsonSchema(OPS['files.write'].result)), ...STD_ERRORS },
      },
    },
  };
  for (const op of ROUTED_OPS) paths[`/v1/sandboxes/{id}/${op}`] = routedPath(op);

  return {
    openapi: '3.1.0',
    info: {
      title: 'forkling',
      version,
      description:
        'REST API of `forkling serve`. The same operations are on the WebSocket /v1/ws (msgpack frames, one per binary message; ' +
        'see protocol/PROTOCOL.md, section "Server operations"). ' +
        'Authenticate with `Authorization: Bearer <token>` when the server has a token file.',
    },
    components: {
      securitySchemes: { bearer: { type: 'http', scheme: 'bearer' } },
      schemas: {
        SandboxInfo: jsonSchema(SandboxInfoSchema),
        ErrorBody: {
          type: 'object',
          properties: {
            code: { type: 'string', enum: [...ERROR_CODES, ...SERVER_ERROR_CODES] },
            message: { type: 'string' },
          },
          required: ['code', 'message'],
        },
        Error: { type: 'object', properties: { error: ref('ErrorBody') }, required: ['error'] },
      },
    },
    security: [{ bearer: [] }, {}],
    paths,
  };
}
