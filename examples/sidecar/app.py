#!/usr/bin/env python3
"""A small application for the wasmrelay sidecar example (Python 3, stdlib only).

wasmrelay POSTs each service call to http://HOST:PORT/calls: the body is the
message value; x-wasmrelay-delivery-id, x-wasmrelay-key and the other
x-wasmrelay-* headers say where it came from; Kafka headers arrive as
x-kafka-header-<name> (and traceparent as is). The answer's body becomes the
data-return record; x-kafka-header-<name> response headers become its headers.

This app accepts JSON orders and answers with a confirmation that carries a
card number (the mask-fields plugin hides it on the way back). An order with
"quantity": 0 gets 400 (wasmrelay dead-letters it); "fail": true gets 503
(wasmrelay retries). A delivery id seen before is answered again without
being processed twice: that is how a receiver handles at-least-once delivery.

    python3 examples/sidecar/app.py --port 8080
"""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

seen = {}


class Calls(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/calls":
            return self.answer(404, {"error": "POST service calls to /calls"})
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        delivery_id = self.headers.get("x-wasmrelay-delivery-id", "")
        if delivery_id in seen:
            return self.answer(200, seen[delivery_id])
        try:
            order = json.loads(body)
        except ValueError:
            return self.answer(400, {"error": "the body is not JSON"})
        if order.get("fail"):
            return self.answer(503, {"error": "temporarily unavailable"})
        if order.get("quantity") == 0:
            return self.answer(400, {"error": "quantity must be at least 1"})
        confirmation = {
            "order": order.get("order"),
            "status": "accepted",
            "delivery_id": delivery_id,
            "card_number": "4111111111111111",
        }
        seen[delivery_id] = confirmation
        print(f"{delivery_id}: {json.dumps(order)}", flush=True)
        self.answer(200, confirmation, {"x-kafka-header-handled-by": "example-app"})

    def answer(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    print(f"example app listening on http://{args.host}:{args.port}/calls", flush=True)
    ThreadingHTTPServer((args.host, args.port), Calls).serve_forever()
