// route-by-field in JavaScript (router world, componentize-js).
//
// route: the value of header `header` (default `process-id`) if present,
// else the top-level field `field` (default `process_id`) of the value
// parsed as a JSON object when it is a string or a number; else no process.
// place: a process whose id starts with `pin_prefix` goes to node `pin_node`
// (when both are set and that node is a candidate); any other is left to
// the relay's built-in placement.

import { configGet } from 'wasmrelay:plugin/host@0.1.0';

const decoder = new TextDecoder('utf-8', { fatal: true });

export function route(msg) {
  const header = configGet('header') ?? 'process-id';
  const field = configGet('field') ?? 'process_id';
  const named = msg.headers.find((h) => h.name === header);
  if (named !== undefined) {
    try {
      return decoder.decode(named.value);
    } catch {
      // A `result` export: a thrown string is the `err` case.
      throw `route-by-field: header \`${header}\` is not UTF-8`;
    }
  }
  if (msg.value === undefined || msg.value === null) return undefined;
  let object;
  try {
    object = JSON.parse(decoder.decode(msg.value));
  } catch {
    return undefined;
  }
  if (object === null || typeof object !== 'object' || Array.isArray(object)) return undefined;
  const id = object[field];
  if (typeof id === 'string') return id;
  if (typeof id === 'number') return String(id);
  return undefined;
}

export function place(processId, nodes) {
  const prefix = configGet('pin_prefix');
  const node = configGet('pin_node');
  if (prefix === undefined || node === undefined || !processId.startsWith(prefix)) {
    return undefined;
  }
  return nodes.some((n) => n.nodeId === node) ? node : undefined;
}
