"""{{name}}: a wasmrelay processor plugin in Python.

Passes each message on with header `x-processed-by` set to the config value
`processed-by` (default `{{name}}`); a message without a value (a tombstone)
is dead-lettered. Raising `Err("reason")` from `process` is its `err` result
(retried by the relay); any other exception is an error too.
"""

from typing import List

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


class WitWorld(wit_world.WitWorld):
    def process(self, msg: Message) -> Outcome:
        if msg.value is None:
            return Outcome_DeadLetter("{{name}}: no value")
        stamp = host.config_get("processed-by") or "{{name}}"
        headers = [h for h in msg.headers if h.name != "x-processed-by"]
        headers.append(Header("x-processed-by", stamp.encode()))
        return Outcome_Emit([OutputMessage(msg.key, msg.value, headers)])

    def process_batch(self, batch: List[Message]) -> List[Result[Outcome, str]]:
        answers: List[Result[Outcome, str]] = []
        for msg in batch:
            try:
                answers.append(Ok(self.process(msg)))
            except Err as e:
                answers.append(e)
        return answers
