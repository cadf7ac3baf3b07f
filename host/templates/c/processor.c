// {{name}}: a wasmrelay processor plugin in C.
//
// Passes each message on with header `x-processed-by` set to the config
// value `processed-by` (default `{{name}}`); a message without a value (a
// tombstone) is dead-lettered.
//
// The bindings are in gen/processor.h (`./build.sh` writes them). The
// argument of an export is owned by the callee: move what you keep, free the
// rest with the generated `*_free` functions. What an export returns must be
// malloc'ed: the generated post-return code frees it.

#include <stdlib.h>
#include <string.h>

#include "processor.h"

static processor_string_t stamp;
static bool stamp_loaded = false;

bool exports_processor_process(processor_message_t *msg, processor_outcome_t *ret,
                               processor_string_t *err) {
  if (!msg->value.is_some) {
    ret->tag = WASMRELAY_PLUGIN_TYPES_OUTCOME_DEAD_LETTER;
    processor_string_dup(&ret->val.dead_letter, "{{name}}: no value");
    wasmrelay_plugin_types_message_free(msg);
    return true;
  }
  if (!stamp_loaded) {
    processor_string_t key;
    processor_string_set(&key, "processed-by");
    if (!wasmrelay_plugin_host_config_get(&key, &stamp)) processor_string_dup(&stamp, "{{name}}");
    stamp_loaded = true;
  }

  // The output takes the input's key and value; its headers are the
  // input's without `x-processed-by`, plus ours.
  wasmrelay_plugin_types_output_message_t *out = malloc(sizeof *out);
  wasmrelay_plugin_types_header_t *headers = malloc((msg->headers.len + 1) * sizeof *headers);
  if (out == NULL || headers == NULL) abort();
  size_t n = 0;
  for (size_t i = 0; i < msg->headers.len; i++) {
    wasmrelay_plugin_types_header_t *h = &msg->headers.ptr[i];
    if (h->name.len == 14 && memcmp(h->name.ptr, "x-processed-by", 14) == 0) {
      wasmrelay_plugin_types_header_free(h);
    } else {
      headers[n++] = *h;
    }
  }
  processor_string_dup(&headers[n].name, "x-processed-by");
  headers[n].value.ptr = malloc(stamp.len ? stamp.len : 1);
  if (headers[n].value.ptr == NULL) abort();
  memcpy(headers[n].value.ptr, stamp.ptr, stamp.len);
  headers[n].value.len = stamp.len;
  n++;
  out->key = msg->key;
  out->value = msg->value;
  out->headers.ptr = headers;
  out->headers.len = n;
  free(msg->headers.ptr);
  processor_string_free(&msg->topic);

  ret->tag = WASMRELAY_PLUGIN_TYPES_OUTCOME_EMIT;
  ret->val.emit.ptr = out;
  ret->val.emit.len = 1;
  return true;
}

void exports_processor_process_batch(processor_list_message_t *batch,
                                     processor_list_result_outcome_string_t *ret) {
  ret->len = batch->len;
  ret->ptr = malloc((batch->len ? batch->len : 1) * sizeof *ret->ptr);
  if (ret->ptr == NULL) abort();
  for (size_t i = 0; i < batch->len; i++) {
    ret->ptr[i].is_err = !exports_processor_process(&batch->ptr[i], &ret->ptr[i].val.ok,
                                                    &ret->ptr[i].val.err);
  }
  // Each message was consumed by `process`; only the array is left.
  free(batch->ptr);
}
