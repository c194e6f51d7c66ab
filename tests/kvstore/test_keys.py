"""Spec 1: chunk keys are deterministic, prefix-chained, layout-bound and pinned."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, InvalidKey
from kvstore.keys import (
    KVLayout,
    chunk_keys,
    config_hash,
    model_identity_hash,
    model_layout,
    partial_key,
    root_key,
    validate_key,
)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout("SmolLM2-135M-Instruct", config_hash({"a": 1}), 30, 3, 64, "float16", 256, 0, 1)
TOKENS = list(range(600))
# Pinned: if one of these changes, the key spec changed and KEY_VERSION must be bumped.
GOLDEN_CONFIG_HASH = "2c6b113b8dd15ffbded9860b43eb0c6c"
GOLDEN_ROOT = "027298f2d979c18869e54cc7477667f9"
GOLDEN_KEYS = ["7464da1327ce3f54ec8b297fc78e44e9", "78cb1ef652d78e2834745fbf9fbc3881"]
GOLDEN_PARTIAL = "8959669b16d8b9a4360cdb80edb35c25"
GOLDEN_SALTED = "ce410211bc8919f743f522b028236959"  # namespace "t", extra b"lora"


def test_golden_values() -> None:
    assert config_hash({"a": 1}) == GOLDEN_CONFIG_HASH
    assert root_key(LAYOUT).hex() == GOLDEN_ROOT
    assert chunk_keys(TOKENS, LAYOUT) == GOLDEN_KEYS
    assert partial_key(TOKENS, LAYOUT) == GOLDEN_PARTIAL
    assert chunk_keys(TOKENS, LAYOUT, namespace="t", extra=b"lora")[0] == GOLDEN_SALTED


def test_recomputed_by_hand_from_the_documented_recipe() -> None:
    def field(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    def h(b: bytes) -> bytes:
        return hashlib.blake2b(b, digest_size=16).digest()

    # an empty kv_scales / kv_format is absent
    fields = {k: v for k, v in dataclasses.asdict(LAYOUT).items() if k not in ("kv_scales", "kv_format") or v}
    fp = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    root = h(field(b"kvstore/v1") + field(b"") + field(fp))
    k0 = h(root + np.arange(0, 256, dtype="<i4").tobytes())
    k1 = h(k0 + np.arange(256, 512, dtype="<i4").tobytes())
    tail = np.arange(512, 600, dtype="<i4").tobytes()
    part = h(k1 + b"partial" + (88).to_bytes(4, "little") + tail)
    assert [root.hex(), k0.hex(), k1.hex(), part.hex()] == [GOLDEN_ROOT, *GOLDEN_KEYS, GOLDEN_PARTIAL]


_CHILD = (
    "from kvstore.keys import *; "
    "L = KVLayout('SmolLM2-135M-Instruct', config_hash({'a': 1}), 30, 3, 64, 'float16', 256, 0, 1); "
    "print(' '.join(chunk_keys(list(range(600)), L) + [partial_key(list(range(600)), L)]))"
)


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_identical_in_a_fresh_process_with_another_hash_seed(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == [*GOLDEN_KEYS, GOLDEN_PARTIAL]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_name", "other-model"),
        ("model_config_hash", config_hash({"a": 2})),
        ("num_layers", 31),
        ("num_kv_heads", 4),
        ("head_dim", 128),
        ("kv_dtype", "bfloat16"),
        ("chunk_size", 200),
        ("tp_rank", 1),
        ("tp_world_size", 2),
        ("kv_scales", "head:0123456789abcdef"),
        ("kv_format", "mla"),
    ],
)
def test_every_layout_field_changes_every_key(field: str, value: object) -> None:
    assert {f.name for f in dataclasses.fields(KVLayout)} >= {field}
    # tp_rank 1 needs a world of 2: compare ranks 0 and 1 of the same world
    base = dataclasses.replace(LAYOUT, tp_world_size=2) if field == "tp_rank" else LAYOUT
    other = dataclasses.replace(base, **{field: value})
    a, b = chunk_keys(TOKENS, base), chunk_keys(TOKENS, other)
    assert a and b and not set(a) & set(b)
    assert partial_key(TOKENS, base) != partial_key(TOKENS, other)


def test_all_layout_fields_are_covered() -> None:
    covered = {"model_name", "model_config_hash", "num_layers", "num_kv_heads", "head_dim", "kv_dtype",
               "chunk_size", "tp_rank", "tp_world_size", "kv_scales", "kv_format"}  # fmt: skip
    assert {f.name for f in dataclasses.fields(KVLayout)} == covered


def test_namespace_and_extra_change_every_key() -> None:
    base = set(chunk_keys(TOKENS, LAYOUT))
    assert not base & set(chunk_keys(TOKENS, LAYOUT, namespace="tenant-a"))
    assert not base & set(chunk_keys(TOKENS, LAYOUT, extra=b"lora-1"))


@pytest.mark.parametrize("shared_chunks", [0, 1, 3])
def test_prompts_sharing_k_full_chunks_share_exactly_k_keys(shared_chunks: int) -> None:
    small = dataclasses.replace(LAYOUT, chunk_size=16)
    rng = np.random.default_rng(shared_chunks)
    a = rng.integers(0, 50_000, size=16 * 5 + 7)
    b = a.copy()
    b[16 * shared_chunks + 3] += 1  # first difference inside chunk `shared_chunks`
    ka, kb = chunk_keys(a, small), chunk_keys(b, small)
    assert len(ka) == len(kb) == 5
    assert ka[:shared_chunks] == kb[:shared_chunks]
    assert not set(ka[shared_chunks:]) & set(kb[shared_chunks:])


def test_keys_depend_on_the_whole_prefix_not_only_the_chunk() -> None:
    small = dataclasses.replace(LAYOUT, chunk_size=4)
    a = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8], small)
    b = chunk_keys([9, 2, 3, 4, 5, 6, 7, 8], small)
    assert a[1] != b[1]  # same second chunk, different first chunk


def test_partial_keys() -> None:
    small = dataclasses.replace(LAYOUT, chunk_size=4)
    assert partial_key([1, 2, 3, 4], small) is None  # ends on a boundary
    assert chunk_keys([1, 2, 3], small) == []
    p = partial_key([1, 2, 3], small)
    assert p is not None and validate_key(p) == p
    assert partial_key([1, 2, 3], small) == p
    assert partial_key([1, 2, 4], small) != p
    assert partial_key([1, 2], small) != p  # the length is part of it
    # a partial key never collides with the full-chunk key of the same tokens
    assert partial_key([1, 2, 3, 4, 5], small) not in chunk_keys([1, 2, 3, 4, 5, 0, 0, 0], small)
    # it chains on the last full chunk
    assert partial_key([1, 2, 3, 4, 5], small) != partial_key([0, 2, 3, 4, 5], small)
    assert chunk_keys([1, 2, 3, 4, 5], small) == chunk_keys([1, 2, 3, 4], small)


def test_token_array_types_do_not_matter() -> None:
    small = dataclasses.replace(LAYOUT, chunk_size=4)
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    expect = chunk_keys(toks, small)
    for arr in (np.array(toks, dtype=np.int64), np.array(toks, dtype=np.int32), tuple(toks)):
        assert chunk_keys(arr, small) == expect


def test_bad_input_raises_typed_errors() -> None:
    with pytest.raises(InvalidArgument):
        KVLayout("m", "h", 0, 3, 64)
    with pytest.raises(InvalidArgument):
        KVLayout("m", "h", 30, 3, 64, kv_dtype="int3")
    with pytest.raises(InvalidArgument):
        KVLayout("m", "h", 30, 3, 64, tp_rank=2, tp_world_size=2)
    with pytest.raises(InvalidArgument):
        chunk_keys([2**31] * 256, LAYOUT)
    near = ("ab" * 16 + "\n", "\n" + "ab" * 16, "ab" * 16 + "\r\n", "ab" * 16 + " ", "ab" * 16 + "\x00")
    for bad in ("", "AB" * 16, "ab" * 15, "zz" * 16, "ab" * 65, None, 123, "../" + "a" * 32, *near):
        with pytest.raises(InvalidKey):
            validate_key(bad)  # type: ignore[arg-type]


SMOL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "transformers_version": "5.0.0",
}  # fmt: skip


def test_model_layout_is_one_fingerprint_for_every_engine() -> None:
    layout = KVLayout.for_model(
        SMOL_CONFIG, model="/m/SmolLM2-135M-Instruct/", kv_dtype="torch.bfloat16", chunk_size=256
    )
    assert layout == KVLayout(
        "SmolLM2-135M-Instruct", model_identity_hash(SMOL_CONFIG), 30, 3, 64, "bfloat16", 256, 0, 1
    )
    # a hub id, a re-saved config (other transformers version, tool keys, key order) -> the same keys
    resaved = {
        "_name_or_path": "/elsewhere",
        **dict(reversed(SMOL_CONFIG.items())),
        "transformers_version": "5.9",
    }
    again = KVLayout.for_model(
        resaved, model="HuggingFaceTB/SmolLM2-135M-Instruct", kv_dtype="bfloat16", chunk_size=256
    )
    assert root_key(again) == root_key(layout)
    assert model_layout(SMOL_CONFIG, model="SmolLM2-135M-Instruct", kv_dtype="bfloat16") == {
        k: v
        for k, v in dataclasses.asdict(layout).items()
        if k != "chunk_size" and (k not in ("kv_scales", "kv_format") or v)
    }


@pytest.mark.parametrize(
    "change",
    [{"model": "SmolLM2-360M"}, {"kv_dtype": "float8_e4m3fn"}, {"kv_dtype": "float16"}, {"chunk_size": 512},
     {"tp_rank": 1, "tp_world_size": 3}, {"config": {**SMOL_CONFIG, "rope_parameters": {"rope_theta": 1.0}}}],
)  # fmt: skip
def test_model_layout_changes_with_model_weights_config_kv_dtype_chunk_and_tp(change: dict) -> None:
    base = {
        "config": SMOL_CONFIG,
        "model": "SmolLM2-135M-Instruct",
        "kv_dtype": "bfloat16",
        "chunk_size": 256,
    }
    args = {**base, **change}
    a = KVLayout.for_model(base.pop("config"), **base)
    b = KVLayout.for_model(args.pop("config"), **args)
    assert root_key(a) != root_key(b)


def test_model_layout_geometry_rules() -> None:
    assert "head_dim" not in SMOL_CONFIG
    assert model_layout(SMOL_CONFIG, model="m", kv_dtype="float16")["head_dim"] == 576 // 9
    tp = model_layout(SMOL_CONFIG, model="m", kv_dtype="float16", tp_rank=1, tp_world_size=3)
    assert (tp["num_kv_heads"], tp["tp_rank"], tp["tp_world_size"]) == (1, 1, 3)
    replicated = model_layout(SMOL_CONFIG, model="m", kv_dtype="float16", tp_rank=5, tp_world_size=6)
    assert replicated["num_kv_heads"] == 1  # more ranks than KV heads: each rank keeps one
    nested = model_layout({"model_type": "vlm", "text_config": SMOL_CONFIG}, model="m", kv_dtype="float16")
    assert nested["num_layers"] == 30 and nested["num_kv_heads"] == 3
    with pytest.raises(InvalidArgument):
        model_layout({"model_type": "llama"}, model="m", kv_dtype="float16")
    with pytest.raises(InvalidArgument):
        model_layout(SMOL_CONFIG, model="/", kv_dtype="float16")
