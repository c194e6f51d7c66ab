"""The protocol between kvstore-server and the SDK (docs/design.md §6-8), readable alone.

- `ops`: every store operation once, for both wires: its data-plane op beside its HTTP routes, its
  request and answer dataclasses, each field's name on each wire (§6).
- `wire`: the HTTP API's routes, headers, batch frame and error bodies (§6).
- `dataplane`: the binary data plane's framing and opcodes on the same port (§7).
- `shm`: same-host shared-memory segments, their header and the regions a client names (§8).
- `arena_table`: the arena index's layout, heartbeat and the client's reader (§8).

It imports only itself, `kvstore.errors` and `kvstore.keys` (`tests/project/test_imports.py`), so
the server (`server/`, `kvstore/tiers/`) and the SDK (`sdk/`) agree through it and never import
each other.
"""

from __future__ import annotations

Blob = bytes | bytearray | memoryview  # the buffers a blob travels as, in every room
