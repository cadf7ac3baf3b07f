// {{name}}: a wasmrelay router plugin in JavaScript.
//
// route: the process id is the value of the header named by the config
// value `header` (default `process-id`); no such header, no process
// (`undefined`). place: `undefined` leaves placement to the relay.

import { configGet } from 'wasmrelay:plugin/host@0.1.0';

const decoder = new TextDecoder();

export function route(msg) {
  const header = configGet('header') ?? 'process-id';
  const named = msg.headers.find((h) => h.name === header);
  return named === undefined ? undefined : decoder.decode(named.value);
}

export function place(processId, nodes) {
  return undefined;
}
