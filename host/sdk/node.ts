// Node.js glue for the SDK: Node 20 has no global WebSocket, so the `ws`
// package stands in (Node 22+ would work with its own, but `ws` lets an idle
// connection not hold the process open). Imported only by the Node entry.
import WebSocket from 'ws';
import { setDefaultWebSocket, type WebSocketLike } from './connection.ts';

setDefaultWebSocket(
  (url, protocols) => new WebSocket(url, protocols, { perMessageDeflate: false }) as unknown as WebSocketLike,
  (ws, idle) => {
    // An idle shared connection must not keep a script alive; a busy one must.
    const sock = (ws as unknown as { _socket?: { ref(): void; unref(): void } })._socket;
    if (idle) sock?.unref();
    else sock?.ref();
  },
);
