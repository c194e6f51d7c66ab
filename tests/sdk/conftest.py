"""The SDK's remote tests run against the same in-process servers as tests/server."""

from tests.server.conftest import server, server_factory  # noqa: F401 (fixtures)
