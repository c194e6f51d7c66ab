"""The kvstore SDK: one `Store` class, in-process (`Store.local`) or remote (`Store.connect`)."""

from kvstore.sdk.backend import Backend
from kvstore.sdk.store import Store

__all__ = ["Backend", "Store"]
