// {{name}}: a wasmrelay processor plugin in JavaScript.
//
// Passes each message on with header `x-processed-by` set to the config
// value `processed-by` (default `{{name}}`); a message without a value (a
// tombstone) is dead-lettered. Throwing a string from `process` is its
// `err` result (retried by the relay); any other exception is an error too.

import { configGet } from 'wasmrelay:plugin/host@0.1.0';

const encoder = new TextEncoder();

export function process(msg) {
  if (msg.value === undefined || msg.value === null) {
    return { tag: 'dead-letter', val: '{{name}}: no value' };
  }
  const stamp = configGet('processed-by') ?? '{{name}}';
  const headers = msg.headers.filter((h) => h.name !== 'x-processed-by');
  headers.push({ name: 'x-processed-by', value: encoder.encode(stamp) });
  return { tag: 'emit', val: [{ key: msg.key, value: msg.value, headers }] };
}

export function processBatch(batch) {
  return batch.map((msg) => {
    try {
      return { tag: 'ok', val: process(msg) };
    } catch (e) {
      return { tag: 'err', val: String(e) };
    }
  });
}
