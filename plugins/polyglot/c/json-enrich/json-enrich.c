// json-enrich in C (wasi-libc, bindings by `wit-bindgen c`).
//
// Checks that the message value is one JSON object, adds a field to it (an
// existing member of the same name is replaced in place, so the key order is
// kept) and sets a header; the key and the other headers are kept. The other
// members are copied as they are, byte for byte. A value that is not a JSON
// object is dead-lettered with `json-enrich: value is not a JSON object:
// <detail>`.
//
// Config keys: `field` (default `enriched_by`), `value` (`wasmrelay`),
// `header` (`x-enriched-by`), `header-value` (= `value`). It also sets
// `x-plugin-version` to PLUGIN_VERSION, so a test can tell which build
// served a message.
//
// Memory: the generated code hands `process` an argument it owns (freed
// here with the generated `*_free`), and frees what `process` returns after
// the host has read it (the post-return function), so every byte returned is
// malloc'ed.

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "processor.h"

#define PLUGIN_VERSION "1"

// Nested arrays and objects deeper than this are refused rather than
// risking the stack.
#define MAX_DEPTH 128

typedef struct {
  char *ptr;
  size_t len;
} text_t;

typedef struct {
  text_t field, value, header, header_value;
} config_t;

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (p == NULL) abort();
  return p;
}

static text_t text_copy(const void *ptr, size_t len) {
  text_t t = {xmalloc(len), len};
  memcpy(t.ptr, ptr, len);
  return t;
}

// The config value `key` (owned, never freed: config is fixed for the life
// of an instance), or `fallback`.
static text_t config_or(const char *key, text_t fallback) {
  processor_string_t name, value;
  processor_string_set(&name, key);
  if (wasmrelay_plugin_host_config_get(&name, &value)) {
    return (text_t){(char *)value.ptr, value.len};
  }
  return fallback;
}

static const config_t *cfg(void) {
  static config_t config;
  static bool loaded = false;
  if (!loaded) {
    config.value = config_or("value", (text_t){"wasmrelay", 9});
    config.field = config_or("field", (text_t){"enriched_by", 11});
    config.header = config_or("header", (text_t){"x-enriched-by", 13});
    config.header_value = config_or("header-value", config.value);
    loaded = true;
  }
  return &config;
}

// --- a growable byte buffer

typedef struct {
  uint8_t *ptr;
  size_t len, cap;
} buf_t;

static void buf_put(buf_t *b, const void *data, size_t n) {
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + n) cap *= 2;
    b->ptr = realloc(b->ptr, cap);
    if (b->ptr == NULL) abort();
    b->cap = cap;
  }
  memcpy(b->ptr + b->len, data, n);
  b->len += n;
}

static void buf_byte(buf_t *b, uint8_t c) { buf_put(b, &c, 1); }

// Appends `t` as a JSON string literal.
static void buf_json_string(buf_t *b, text_t t) {
  static const char hex[] = "0123456789abcdef";
  buf_byte(b, '"');
  for (size_t i = 0; i < t.len; i++) {
    uint8_t c = (uint8_t)t.ptr[i];
    if (c == '"' || c == '\\') {
      buf_byte(b, '\\');
      buf_byte(b, c);
    } else if (c < 0x20) {
      char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
      buf_put(b, esc, 6);
    } else {
      buf_byte(b, c);
    }
  }
  buf_byte(b, '"');
}

// --- a validating JSON scanner: it finds where values start and end.

typedef struct {
  const uint8_t *p, *start, *end;
  char error[96];
} scan_t;

static bool fail(scan_t *s, const char *what) {
  if (s->error[0] == '\0') {
    snprintf(s->error, sizeof s->error, "%s at byte %zu", what, (size_t)(s->p - s->start));
  }
  return false;
}

static void skip_ws(scan_t *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static bool scan_string(scan_t *s) {
  if (s->p >= s->end || *s->p != '"') return fail(s, "expected a string");
  s->p++;
  while (s->p < s->end) {
    uint8_t c = *s->p++;
    if (c == '"') return true;
    if (c < 0x20) return fail(s, "control character in a string");
    if (c == '\\') {
      if (s->p >= s->end) break;
      c = *s->p++;
      if (c == 'u') {
        for (int i = 0; i < 4; i++, s->p++) {
          if (s->p >= s->end || !strchr("0123456789abcdefABCDEF", *s->p) || *s->p == 0) {
            return fail(s, "bad \\u escape");
          }
        }
      } else if (!strchr("\"\\/bfnrt", c) || c == 0) {
        return fail(s, "bad escape");
      }
    }
  }
  return fail(s, "unterminated string");
}

static bool scan_digits(scan_t *s) {
  const uint8_t *from = s->p;
  while (s->p < s->end && *s->p >= '0' && *s->p <= '9') s->p++;
  return s->p > from;
}

static bool scan_number(scan_t *s) {
  if (s->p < s->end && *s->p == '-') s->p++;
  if (s->p < s->end && *s->p == '0') {
    s->p++;
  } else if (!scan_digits(s)) {
    return fail(s, "expected a value");
  }
  if (s->p < s->end && *s->p == '.') {
    s->p++;
    if (!scan_digits(s)) return fail(s, "bad number");
  }
  if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
    s->p++;
    if (s->p < s->end && (*s->p == '+' || *s->p == '-')) s->p++;
    if (!scan_digits(s)) return fail(s, "bad number");
  }
  return true;
}

static bool scan_literal(scan_t *s, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0) return fail(s, "expected a value");
  s->p += n;
  return true;
}

static bool scan_value(scan_t *s, int depth);

// Scans `[...]` or `{...}` from the opening bracket.
static bool scan_container(scan_t *s, int depth, bool object) {
  if (depth > MAX_DEPTH) return fail(s, "nested too deep");
  uint8_t close = object ? '}' : ']';
  s->p++;
  skip_ws(s);
  if (s->p < s->end && *s->p == close) {
    s->p++;
    return true;
  }
  for (;;) {
    if (object) {
      skip_ws(s);
      if (!scan_string(s)) return false;
      skip_ws(s);
      if (s->p >= s->end || *s->p != ':') return fail(s, "expected `:`");
      s->p++;
    }
    if (!scan_value(s, depth + 1)) return false;
    skip_ws(s);
    if (s->p < s->end && *s->p == ',') {
      s->p++;
      continue;
    }
    if (s->p < s->end && *s->p == close) {
      s->p++;
      return true;
    }
    return fail(s, object ? "expected `,` or `}`" : "expected `,` or `]`");
  }
}

static bool scan_value(scan_t *s, int depth) {
  skip_ws(s);
  if (s->p >= s->end) return fail(s, "unexpected end of input");
  switch (*s->p) {
    case '{': return scan_container(s, depth, true);
    case '[': return scan_container(s, depth, false);
    case '"': return scan_string(s);
    case 't': return scan_literal(s, "true");
    case 'f': return scan_literal(s, "false");
    case 'n': return scan_literal(s, "null");
    default: return scan_number(s);
  }
}

static const char *kind_of(uint8_t first) {
  switch (first) {
    case '[': return "an array";
    case '"': return "a string";
    case 't':
    case 'f': return "a boolean";
    case 'n': return "null";
    default: return "a number";
  }
}

// Writes the object at `s` (already checked to be one valid object) with
// member `field` set to `value`: replaced in place, or appended.
static void enrich(const uint8_t *json, size_t len, const config_t *c, buf_t *out) {
  scan_t s = {json, json, json + len, {0}};
  bool replaced = false, first = true;
  skip_ws(&s);
  s.p++;  // '{'
  buf_byte(out, '{');
  for (;;) {
    skip_ws(&s);
    if (*s.p == '}') break;
    const uint8_t *key = s.p;
    scan_string(&s);
    const uint8_t *key_end = s.p;
    skip_ws(&s);
    s.p++;  // ':'
    skip_ws(&s);
    const uint8_t *value = s.p;
    scan_value(&s, 0);
    const uint8_t *value_end = s.p;
    if (!first) buf_byte(out, ',');
    first = false;
    buf_put(out, key, (size_t)(key_end - key));
    buf_byte(out, ':');
    // Raw comparison of the name between the quotes: a name written with
    // escapes is another name here.
    bool same = (size_t)(key_end - key - 2) == c->field.len &&
                memcmp(key + 1, c->field.ptr, c->field.len) == 0;
    if (same && !replaced) {
      buf_json_string(out, c->value);
      replaced = true;
    } else {
      buf_put(out, value, (size_t)(value_end - value));
    }
    skip_ws(&s);
    if (*s.p == ',') s.p++;
  }
  if (!replaced) {
    if (!first) buf_byte(out, ',');
    buf_json_string(out, c->field);
    buf_byte(out, ':');
    buf_json_string(out, c->value);
  }
  buf_byte(out, '}');
}

// --- building the output message

typedef struct {
  wasmrelay_plugin_types_header_t *ptr;
  size_t len, cap;
} headers_t;

static void headers_push(headers_t *h, const void *name, size_t name_len, const void *value, size_t value_len) {
  if (h->len == h->cap) {
    h->cap = h->cap ? h->cap * 2 : 4;
    h->ptr = realloc(h->ptr, h->cap * sizeof *h->ptr);
    if (h->ptr == NULL) abort();
  }
  text_t n = text_copy(name, name_len), v = text_copy(value, value_len);
  h->ptr[h->len].name = (processor_string_t){(uint8_t *)n.ptr, n.len};
  h->ptr[h->len].value = (processor_list_u8_t){(uint8_t *)v.ptr, v.len};
  h->len++;
}

// Sets header `name`: the first one of that name gets `value`, later ones
// are dropped; appended when there is none.
static void headers_set(headers_t *h, text_t name, text_t value) {
  bool done = false;
  size_t kept = 0;
  for (size_t i = 0; i < h->len; i++) {
    wasmrelay_plugin_types_header_t *hd = &h->ptr[i];
    bool same = hd->name.len == name.len && memcmp(hd->name.ptr, name.ptr, name.len) == 0;
    if (same && done) {
      free(hd->name.ptr);
      free(hd->value.ptr);
      continue;
    }
    if (same) {
      free(hd->value.ptr);
      text_t v = text_copy(value.ptr, value.len);
      hd->value = (processor_list_u8_t){(uint8_t *)v.ptr, v.len};
      done = true;
    }
    h->ptr[kept++] = *hd;
  }
  h->len = kept;
  if (!done) headers_push(h, name.ptr, name.len, value.ptr, value.len);
}

static void dead_letter(processor_outcome_t *ret, const char *fmt, ...) {
  char reason[256];
  va_list args;
  va_start(args, fmt);
  vsnprintf(reason, sizeof reason, fmt, args);
  va_end(args);
  ret->tag = WASMRELAY_PLUGIN_TYPES_OUTCOME_DEAD_LETTER;
  processor_string_dup(&ret->val.dead_letter, reason);
}

static void process_one(const processor_message_t *msg, processor_outcome_t *ret) {
  const config_t *c = cfg();
  if (!msg->value.is_some) {
    dead_letter(ret, "json-enrich: value is not a JSON object: no value (tombstone)");
    return;
  }
  const uint8_t *json = msg->value.val.ptr;
  size_t len = msg->value.val.len;
  scan_t s = {json, json, json + len, {0}};
  bool valid = scan_value(&s, 0);
  if (valid) {
    skip_ws(&s);
    if (s.p != s.end) valid = fail(&s, "trailing characters");
  }
  if (!valid) {
    dead_letter(ret, "json-enrich: value is not a JSON object: %s", s.error);
    return;
  }
  s.p = json;
  skip_ws(&s);
  if (*s.p != '{') {
    dead_letter(ret, "json-enrich: value is not a JSON object: got %s", kind_of(*s.p));
    return;
  }

  buf_t value = {0};
  enrich(json, len, c, &value);
  headers_t headers = {0};
  for (size_t i = 0; i < msg->headers.len; i++) {
    const wasmrelay_plugin_types_header_t *h = &msg->headers.ptr[i];
    headers_push(&headers, h->name.ptr, h->name.len, h->value.ptr, h->value.len);
  }
  headers_set(&headers, c->header, c->header_value);
  headers_set(&headers, (text_t){"x-plugin-version", 16}, (text_t){PLUGIN_VERSION, strlen(PLUGIN_VERSION)});

  wasmrelay_plugin_types_output_message_t *out = xmalloc(sizeof *out);
  out->key.is_some = msg->key.is_some;
  if (msg->key.is_some) {
    text_t key = text_copy(msg->key.val.ptr, msg->key.val.len);
    out->key.val = (processor_list_u8_t){(uint8_t *)key.ptr, key.len};
  }
  out->value.is_some = true;
  out->value.val = (processor_list_u8_t){value.ptr, value.len};
  out->headers = (wasmrelay_plugin_types_list_header_t){headers.ptr, headers.len};
  ret->tag = WASMRELAY_PLUGIN_TYPES_OUTCOME_EMIT;
  ret->val.emit = (wasmrelay_plugin_types_list_output_message_t){out, 1};
}

bool exports_processor_process(processor_message_t *msg, processor_outcome_t *ret,
                               processor_string_t *err) {
  process_one(msg, ret);
  wasmrelay_plugin_types_message_free(msg);
  return true;
}

void exports_processor_process_batch(processor_list_message_t *batch,
                                     processor_list_result_outcome_string_t *ret) {
  ret->len = batch->len;
  ret->ptr = xmalloc(batch->len * sizeof *ret->ptr);
  for (size_t i = 0; i < batch->len; i++) {
    ret->ptr[i].is_err = false;
    process_one(&batch->ptr[i], &ret->ptr[i].val.ok);
  }
  processor_list_message_free(batch);
}
