// json-enrich in JavaScript (componentize-js): parses the message value as a
// JSON object, adds a field to it and sets a header; the key and the other
// headers are kept, and so is the object's key order (an existing field of
// the same name is overwritten in place). A value that is not a JSON object
// is dead-lettered with `json-enrich: value is not a JSON object: <detail>`.
//
// Config keys: `field` (default `enriched_by`), `value` (`wasmrelay`),
// `header` (`x-enriched-by`), `header-value` (= `value`).
// It also sets `x-plugin-version` to PLUGIN_VERSION, so a test can tell
// which build served a message.

import { configGet } from 'wasmrelay:plugin/host@0.1.0';

const PLUGIN_VERSION = '1';

const encoder = new TextEncoder();
const decoder = new TextDecoder('utf-8', { fatal: true });

// Config is fixed for the life of an instance, so it is read once.
let config;
function cfg() {
  if (config === undefined) {
    const value = configGet('value') ?? 'wasmrelay';
    config = {
      field: configGet('field') ?? 'enriched_by',
      value,
      header: configGet('header') ?? 'x-enriched-by',
      headerValue: encoder.encode(configGet('header-value') ?? value),
    };
  }
  return config;
}

// Replaces the first header named `name` (dropping later ones) or appends it.
function setHeader(headers, name, value) {
  const first = headers.findIndex((h) => h.name === name);
  if (first < 0) {
    headers.push({ name, value });
    return headers;
  }
  headers[first] = { name, value };
  return headers.filter((h, i) => i <= first || h.name !== name);
}

function kind(v) {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'an array';
  return { boolean: 'a boolean', number: 'a number', string: 'a string' }[typeof v];
}

function notAnObject(detail) {
  return { tag: 'dead-letter', val: `json-enrich: value is not a JSON object: ${detail}` };
}

export function process(msg) {
  const c = cfg();
  if (msg.value === undefined || msg.value === null) {
    return notAnObject('no value (tombstone)');
  }
  let object;
  try {
    object = JSON.parse(decoder.decode(msg.value));
  } catch (e) {
    return notAnObject(e.message);
  }
  if (object === null || typeof object !== 'object' || Array.isArray(object)) {
    return notAnObject(`got ${kind(object)}`);
  }
  object[c.field] = c.value;
  let headers = setHeader(msg.headers.slice(), c.header, c.headerValue);
  headers = setHeader(headers, 'x-plugin-version', encoder.encode(PLUGIN_VERSION));
  return {
    tag: 'emit',
    val: [{ key: msg.key, value: encoder.encode(JSON.stringify(object)), headers }],
  };
}

export function processBatch(batch) {
  return batch.map((msg) => {
    try {
      return { tag: 'ok', val: process(msg) };
    } catch (e) {
      return { tag: 'err', val: `json-enrich: ${e}` };
    }
  });
}
