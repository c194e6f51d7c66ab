"""The kvstore SDK: one `Store` class, in-process (`Store.local`) or remote (`Store.connect`)."""

from sdk.backend import Backend
from sdk.store import Store

__all__ = ["Backend", "Store"]
