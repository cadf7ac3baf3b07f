"""json-enrich in Python (componentize-py).

Parses the message value as a JSON object, adds a field to it and sets a
header; the key and the other headers are kept, and so is the object's key
order (an existing field of the same name is overwritten in place). A value
that is not a JSON object is dead-lettered with
`json-enrich: value is not a JSON object: <detail>`.

Config keys: `field` (default `enriched_by`), `value` (`wasmrelay`),
`header` (`x-enriched-by`), `header-value` (= `value`). It also sets
`x-plugin-version` to PLUGIN_VERSION, so a test can tell which build served
a message.
"""

import json
from typing import List, Optional

import wit_world
from componentize_py_types import Err, Ok, Result
from wit_world.imports import host
from wit_world.imports.types import (
    Header,
    Message,
    Outcome,
    Outcome_DeadLetter,
    Outcome_Emit,
    OutputMessage,
)

PLUGIN_VERSION = "1"


class Config:
    def __init__(self) -> None:
        self.field = host.config_get("field") or "enriched_by"
        self.value = host.config_get("value") or "wasmrelay"
        self.header = host.config_get("header") or "x-enriched-by"
        self.header_value = (host.config_get("header-value") or self.value).encode()


# Config is fixed for the life of an instance, so it is read once.
_config: Optional[Config] = None


def cfg() -> Config:
    global _config
    if _config is None:
        _config = Config()
    return _config


def set_header(headers: List[Header], name: str, value: bytes) -> List[Header]:
    """Replaces the first header named `name` (dropping later ones) or appends it."""
    out: List[Header] = []
    done = False
    for h in headers:
        if h.name != name:
            out.append(h)
        elif not done:
            out.append(Header(name, value))
            done = True
    if not done:
        out.append(Header(name, value))
    return out


KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
         str: "a string", list: "an array"}


def not_an_object(detail: str) -> Outcome:
    return Outcome_DeadLetter(f"json-enrich: value is not a JSON object: {detail}")


class WitWorld(wit_world.WitWorld):
    def process(self, msg: Message) -> Outcome:
        c = cfg()
        if msg.value is None:
            return not_an_object("no value (tombstone)")
        try:
            obj = json.loads(msg.value)
        except ValueError as e:
            return not_an_object(str(e))
        if not isinstance(obj, dict):
            return not_an_object("got " + KINDS.get(type(obj), "something else"))
        obj[c.field] = c.value
        value = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        headers = set_header(msg.headers, c.header, c.header_value)
        headers = set_header(headers, "x-plugin-version", PLUGIN_VERSION.encode())
        return Outcome_Emit([OutputMessage(msg.key, value, headers)])

    def process_batch(self, batch: List[Message]) -> List[Result[Outcome, str]]:
        answers: List[Result[Outcome, str]] = []
        for msg in batch:
            try:
                answers.append(Ok(self.process(msg)))
            except Err as e:
                answers.append(e)
            except Exception as e:  # noqa: BLE001 - one message's failure is its own answer
                answers.append(Err(f"json-enrich: {e}"))
        return answers
