"""{{name}}: a wasmrelay router plugin in Python.

route: the process id is the value of the header named by the config value
`header` (default `process-id`); no such header, no process (None).
place: None leaves placement to the relay's built-in policy.
"""

from typing import List, Optional

import wit_world
from componentize_py_types import Err
from wit_world.imports import host
from wit_world.imports.types import Message, NodeLoad


class WitWorld(wit_world.WitWorld):
    def route(self, msg: Message) -> Optional[str]:
        header = host.config_get("header") or "process-id"
        for h in msg.headers:
            if h.name == header:
                try:
                    return h.value.decode()
                except UnicodeDecodeError:
                    raise Err(f"{{name}}: header `{header}` is not UTF-8")
        return None

    def place(self, process_id: str, nodes: List[NodeLoad]) -> Optional[str]:
        return None
