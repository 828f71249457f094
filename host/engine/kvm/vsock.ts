// Host side of a VM's virtio-vsock: a Unix socket per VM. Connecting to a
// guest port is `CONNECT <port>\n`, answered `OK <host port>\n` once the
// guest accepted; the device closes the connection when the guest refuses
// (nothing listens yet) or does not answer. After OK the socket is a plain
// byte stream to the guest's AF_VSOCK socket.
import { connect, type Socket } from 'node:net';
import { AgentClient } from '../../agent/client.ts';

export class VsockConnectError extends Error {
  constructor(
    message: string,
    /** true when trying again later may work (agent not listening yet) */
    readonly retryable: boolean,
  ) {
    super(message);
    this.name = 'VsockConnectError';
  }
}

const MAX_LINE = 64;

/**
 * One attempt: resolves with the bridged socket, paused (bytes that followed
 * the OK line are pushed back into it; the caller resumes it once it listens),
 * or rejects with VsockConnectError.
 */
export function vsockConnect(udsPath: string, port: number, timeoutMs: number): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const sock = connect(udsPath);
    let buf = Buffer.alloc(0);
    let settled = false;
    const finish = (err: VsockConnectError | null) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      sock.removeListener('data', onData);
      sock.removeListener('error', onError);
      sock.removeListener('close', onClose);
      if (err) {
        sock.destroy();
        reject(err);
      } else {
        resolve(sock);
      }
    };
    const timer = setTimeout(
      () => finish(new VsockConnectError(`vsock port ${port}: no answer within ${timeoutMs} ms`, true)),
      timeoutMs,
    );
    const onError = (e: NodeJS.ErrnoException) => {
      // ENOENT: the VM's socket is not there (any more). ECONNREFUSED/EAGAIN: its
      // listener is busy. EPIPE/ECONNRESET: the device closed the connection
      // before we wrote CONNECT (the guest refused it), as 'close' below.
      const retryable = e.code === 'ECONNREFUSED' || e.code === 'EAGAIN' || e.code === 'EPIPE' || e.code === 'ECONNRESET';
      finish(new VsockConnectError(`vsock ${udsPath}: ${e.code ?? e.message}`, retryable));
    };
    const onClose = () => finish(new VsockConnectError(`vsock port ${port}: the guest refused the connection`, true));
    const onData = (chunk: Buffer) => {
      buf = Buffer.concat([buf, chunk]);
      const nl = buf.indexOf(0x0a);
      if (nl < 0) {
        if (buf.length > MAX_LINE) finish(new VsockConnectError('vsock: malformed answer from the device', false));
        return;
      }
      const line = buf.subarray(0, nl).toString('latin1');
      const rest = buf.subarray(nl + 1);
      if (!/^OK \d+$/.test(line)) {
        finish(new VsockConnectError(`vsock: unexpected answer ${JSON.stringify(line.slice(0, MAX_LINE))}`, false));
        return;
      }
      sock.pause();
      if (rest.length) sock.unshift(rest);
      finish(null);
    };
    sock.on('error', onError);
    sock.on('close', onClose);
    sock.on('data', onData);
    sock.once('connect', () => sock.write(`CONNECT ${port}\n`));
  });
}

/** One attempt to reach the guest agent on `port`: an AgentClient on the bridged stream (no request sent yet). */
export async function connectAgent(udsPath: string, port: number, timeoutMs: number): Promise<AgentClient> {
  const sock = await vsockConnect(udsPath, port, timeoutMs);
  sock.setNoDelay?.(true);
  const client = new AgentClient(sock);
  // vsockConnect hands the socket over paused (no byte after its OK line is
  // lost); a 'data' listener does not restart a paused stream.
  sock.resume();
  return client;
}
