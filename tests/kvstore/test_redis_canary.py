"""Canary: the redis tier sends values without copying them through a redis-py constructor argument
(`command_packer`) and class (`PythonRespSerializer`) that redis-py does not document. When an upgrade
changes either, these fail loudly (pyproject.toml pins redis below the next major version)."""

from __future__ import annotations

import inspect

import redis
from redis.connection import AbstractConnection

from kvstore.tiers.redis.connection import ZeroCopyConnection, ZeroCopySSLConnection


def test_connections_take_a_command_packer():
    assert "command_packer" in inspect.signature(AbstractConnection.__init__).parameters


def test_large_values_are_sent_as_they_are():
    conn = ZeroCopyConnection(host="127.0.0.1", port=1)  # packing connects nowhere
    for value in (bytes(100_000), memoryview(bytearray(100_000)).toreadonly()):
        chunks = conn.pack_command("SET", "k", value)
        assert any(chunk is value for chunk in chunks), "redis-py copied the value"
        assert b"".join(bytes(c) for c in chunks).endswith(bytes(value) + b"\r\n")
    small = conn.pack_command("SET", "k", b"v")
    assert b"".join(small) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"


def test_the_tls_connection_too():
    conn = ZeroCopySSLConnection(host="127.0.0.1", port=1)
    value = bytes(100_000)
    assert any(chunk is value for chunk in conn.pack_command("SET", "k", value))


def test_a_cluster_client_takes_a_connection_class():
    assert "connection_class" in redis.cluster.REDIS_ALLOWED_KEYS
