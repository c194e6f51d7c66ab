"""What `KVStoreConnectorV1` serves of vLLM's settings, and the check that refuses the rest before vLLM
does any work.

`MATRIX` is the support matrix of docs/vllm.md, one row per vLLM setting: supported, required or
refused, what happens (for a refusal: its message), and the tests that show it
(`tests/connectors/vllm/test_vllm_support.py` holds the page's table to `render_matrix()` and checks
that every test it names exists).

`refusal(vllm_config)` reads a `VllmConfig` duck-typed (no vLLM import: tested without one) and gives
the first setting the connector cannot serve as one sentence that says what to change, or None;
`check_supported` raises it as a `ConfigError`. `connectors/vllm.py` runs it while vLLM builds its
`VllmConfig` (vLLM looks the connector class up there, to ask whether it supports the hybrid KV cache
manager), so `LLM(...)` or `vllm serve` fails in the user's own process before a worker starts or a
weight loads, and again when each connector is built (a config vLLM built without asking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvstore.connectors.config import KVTransferConfig

from kvstore.errors import ConfigError

Status = Literal["supported", "required", "refused"]
# vLLM's --kv-cache-dtype values the connector moves as they are (fp8 ones as their bytes)
PLAIN_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
POLICY = (
    'KVStoreConnectorV1 needs "kv_load_failure_policy": "recompute" in --kv-transfer-config (or '
    "LLM(kv_transfer_config=...)), got {policy!r}: kvstore is a cache, and with vLLM's default 'fail' a chunk "
    "that cannot be loaded (evicted, corrupt, unreachable) fails its request instead of being recomputed"
)
NO_SERVER = (
    "KVStoreConnectorV1 needs a kvstore-server: set kv_connector_extra_config.url (vLLM's scheduler and "
    "worker are two processes; an in-process store would be two stores)"
)
TP = (
    "KVStoreConnectorV1 does not serve tensor_parallel_size={size} yet: set --tensor-parallel-size 1 "
    "(LLM(tensor_parallel_size=1)) or drop --kv-transfer-config"
)
PP = (
    "KVStoreConnectorV1 does not serve pipeline_parallel_size={size} yet: set --pipeline-parallel-size 1 "
    "(LLM(pipeline_parallel_size=1)) or drop --kv-transfer-config"
)
CACHE_DTYPE = (
    "KVStoreConnectorV1 does not move a {dtype!r} KV cache: set --kv-cache-dtype (LLM(kv_cache_dtype=...)) "
    "to one of {choices}"
)
MLA = (
    "KVStoreConnectorV1 does not move an MLA (latent) KV cache yet: set VLLM_MLA_DISABLE=1 to run "
    "{model!r} with plain attention, or drop --kv-transfer-config"
)
HYBRID = (
    "KVStoreConnectorV1 does not move the state of {model!r}'s Mamba / linear-attention layers yet: "
    "drop --kv-transfer-config to serve it"
)


@dataclass(frozen=True)
class Row:
    setting: str
    status: Status
    behaviour: str  # what happens; for a refusal, its message
    tests: tuple[str, ...] = ()


def _msg(template: str, **values: Any) -> str:
    return template.format(**values)


MATRIX: tuple[Row, ...] = (
    Row("`kv_role` `kv_both`", "supported", "loads and saves",
        ("test_vllm_store.py::test_a_new_vllm_loads_every_full_chunk_and_answers_like_the_cold_run",)),
    Row("`kv_role` `kv_producer` / `kv_consumer`", "supported", "prefill/decode through `kvstore-engine proxy`",
        ("test_vllm_pd.py::test_producer_and_consumer_through_the_proxy_answer_like_one_vllm",)),
    Row("`kv_load_failure_policy` `recompute`", "required", "a chunk that cannot be loaded is recomputed",
        ("test_vllm_store.py::test_a_corrupt_chunk_is_recomputed_with_identical_output",
         "test_vllm_store.py::test_a_dead_store_is_a_recompute_with_identical_output")),
    Row("`kv_load_failure_policy` `fail` (vLLM's default)", "refused", _msg(POLICY, policy="fail"),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("`kv_connector_extra_config.url` `local` (no server)", "refused", NO_SERVER,
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("a token the store rejects", "refused",
        "the message names `kv_connector_extra_config` and `\"token_file\"`, never the token",
        ("test_vllm_config.py::test_a_rejected_token_names_vllms_setting",)),
    Row("`tensor_parallel_size` > 1", "refused", _msg(TP, size=2),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("`pipeline_parallel_size` > 1", "refused", _msg(PP, size=2),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("`--dtype` bfloat16 / float16 / float32 (KV cache `auto`)", "supported",
        "the same chunk keys as `kvstore-engine` for the same model directory",
        ("test_vllm_config.py::test_vllm_and_kvstore_engine_compute_one_fingerprint", "test_vllm_cross_engine.py")),
    Row("`--kv-cache-dtype` fp8 / fp8_e4m3 / fp8_e5m2", "refused",
        _msg(CACHE_DTYPE, dtype="fp8", choices=", ".join(PLAIN_CACHE_DTYPES)),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("any other `--kv-cache-dtype` (fp8_inc, *_per_token_head, nvfp4, turboquant_*, ...)", "refused",
        _msg(CACHE_DTYPE, dtype="int8_per_token_head", choices=", ".join(PLAIN_CACHE_DTYPES)),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("`chunk_size` not a multiple of the block size", "refused", "a `ConfigError` from the connector's settings",
        ("test_vllm_config.py::test_what_the_connector_cannot_serve_is_refused_at_startup",)),
    Row("MLA (DeepSeek / Kimi / GLM latent KV)", "refused", _msg(MLA, model="MODEL"),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("sliding-window layers (Gemma-3, Mistral)", "supported",
        "vLLM turns its hybrid KV cache manager off (the connector is not `SupportsHMA`): the window layers "
        "keep every block, and reuse is exact", ()),
    Row("Mamba / linear-attention hybrids", "refused", _msg(HYBRID, model="MODEL"),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("CPU attention layout, AVX-512/generic or AMX", "supported",
        "converted; checked at startup against vLLM's own cache writer",
        ("test_layouts.py::test_vllm_cpu_layout_matches_vllms_own_cache_writer",)),
    Row("CPU attention layout of another ISA", "refused",
        "`vLLM's CPU KV cache layout for ISA '...' is not the '...' one KVStoreConnectorV1 converts` (at startup, "
        "from the worker)", ()),
    Row("CUDA (flash-attn NHD/HND)", "supported", "converted; checked only on a GPU",
        ("test_layouts.py::test_vllm_cuda_layout_matches_vllms_own_flash_cache_writer",)),
    Row("`cache_salt`, LoRA adapters", "supported", "part of the request's chunk keys: isolated",
        ("test_vllm_scheduler.py::test_a_stored_prefix_loads_into_the_requests_blocks_and_a_salted_request_never_sees_it",)),
    Row("preemption", "supported", "the partial chunk is saved from the request's last step",
        ("test_vllm_scheduler.py::test_a_preempted_requests_partial_chunk_is_saved_from_its_last_step",)),
)  # fmt: skip


def render_matrix() -> str:
    """`MATRIX` as the markdown table of docs/vllm.md's support matrix."""
    lines = ["| vLLM setting | status | what happens | test |", "|---|---|---|---|"]
    for row in MATRIX:
        what = (
            row.behaviour
            if row.status != "refused" or row.behaviour.startswith("`")
            else f"`{row.behaviour}`"
        )
        tests = ", ".join(f"`{t}`" for t in row.tests) or "none"
        lines.append(f"| {row.setting} | {row.status} | {what} | {tests} |")
    return "\n".join(lines)


def _model_name(vllm_config: Any) -> str:
    mc = getattr(vllm_config, "model_config", None)
    return str(getattr(mc, "served_model_name", None) or getattr(mc, "model", "the model"))


def _has_state_layers(model_config: Any) -> bool:
    """Whether the model has layers whose state is not a per-token KV (Mamba, linear attention, conv)."""
    try:
        if bool(getattr(model_config, "is_hybrid", False)) or bool(
            getattr(model_config, "has_inner_state", False)
        ):
            return True
    except (AttributeError, RuntimeError, ValueError):
        pass
    text = getattr(model_config, "hf_text_config", None)
    kinds = getattr(text, "layer_types", None) or ()
    return any(k not in ("full_attention", "sliding_attention", "attention") for k in kinds)


def refusal(vllm_config: Any) -> str | None:
    """The first setting of `vllm_config` the connector cannot serve, as the sentence that refuses it."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return None
    policy = getattr(ktc, "kv_load_failure_policy", "fail")
    if policy != "recompute":  # vLLM's default is "fail"
        return _msg(POLICY, policy=policy)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    extra["kv_role"] = getattr(ktc, "kv_role", "kv_both")
    block_size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    if isinstance(block_size, int) and "block_size" not in extra:
        extra["block_size"] = block_size  # chunk_size must be a multiple of it
    # the connector's own settings: a bad one is a ConfigError naming it, now
    if KVTransferConfig.from_mapping(extra).is_local:
        return NO_SERVER
    par = getattr(vllm_config, "parallel_config", None)
    if par is not None and par.tensor_parallel_size != 1:
        return _msg(TP, size=par.tensor_parallel_size)
    if par is not None and par.pipeline_parallel_size != 1:
        return _msg(PP, size=par.pipeline_parallel_size)
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype not in PLAIN_CACHE_DTYPES:
        return _msg(CACHE_DTYPE, dtype=cache_dtype, choices=", ".join(PLAIN_CACHE_DTYPES))
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "use_mla", False):
        return _msg(MLA, model=_model_name(vllm_config))
    if mc is not None and _has_state_layers(mc):
        return _msg(HYBRID, model=_model_name(vllm_config))
    return None


def check_supported(vllm_config: Any) -> None:
    """Raise `ConfigError` with `refusal(vllm_config)` when there is one."""
    message = refusal(vllm_config)
    if message is not None:
        raise ConfigError(message)
