// {{name}}: a wasmrelay router plugin in C.
//
// route: the process id is the value of the header named by the config
// value `header` (default `process-id`); no such header, no process.
// place: leaves placement to the relay's built-in policy.
//
// The bindings are in gen/router.h (`./build.sh` writes them). The
// argument of an export is owned by the callee (free it with the generated
// `*_free` functions); what an export returns must be malloc'ed.

#include <stdlib.h>
#include <string.h>

#include "router.h"

bool exports_router_route(router_message_t *msg, router_option_string_t *ret,
                          router_string_t *err) {
  router_string_t key, header;
  router_string_set(&key, "header");
  if (!wasmrelay_plugin_host_config_get(&key, &header)) router_string_dup(&header, "process-id");
  ret->is_some = false;
  for (size_t i = 0; i < msg->headers.len; i++) {
    wasmrelay_plugin_types_header_t *h = &msg->headers.ptr[i];
    if (h->name.len == header.len && memcmp(h->name.ptr, header.ptr, header.len) == 0) {
      ret->is_some = true;
      ret->val.ptr = malloc(h->value.len ? h->value.len : 1);
      if (ret->val.ptr == NULL) abort();
      memcpy(ret->val.ptr, h->value.ptr, h->value.len);
      ret->val.len = h->value.len;
      break;
    }
  }
  router_string_free(&header);
  wasmrelay_plugin_types_message_free(msg);
  return true;
}

bool exports_router_place(router_string_t *process_id, router_list_node_load_t *nodes,
                          router_option_string_t *ret, router_string_t *err) {
  ret->is_some = false;
  router_string_free(process_id);
  router_list_node_load_free(nodes);
  return true;
}
