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

Status = Literal["supported", "required", "refused", "runs, no reuse"]
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
CACHE_DTYPE = (
    "KVStoreConnectorV1 does not move a {dtype!r} KV cache (its scales are per token and head, or its format is "
    "not one kvstore stores): set --kv-cache-dtype (LLM(kv_cache_dtype=...)) to one of {choices}"
)
MLA_CODEC = (
    "KVStoreConnectorV1 stores an MLA latent KV cache raw (its codecs quantise K and V, not a latent): set "
    'kv_connector_extra_config.codec to "raw" (got {codec!r})'
)
WINDOW = (
    "KVStoreConnectorV1 needs a sliding window that is a multiple of the block size (window {window}, "
    "--block-size {block}): set --block-size to a divisor of {window}, or --disable-hybrid-kv-cache-manager"
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
    Row("`tensor_parallel_size` > 1", "supported",
        "TP-free chunks (the keys and bytes of TP=1): each rank loads only its KV heads, saves gather the heads "
        "to TP rank 0, which stores the chunk; reused at any TP size and by `kvstore-engine`. Real vLLM CPU "
        "engines shown at TP=1, 2 and 4 (TP=2 to TP=1 and TP=4, and back; TP=4 with two ranks a core)",
        ("test_vllm_tp.py::test_tp2_stores_and_a_fresh_tp1_reuses_it_token_for_token",
         "test_vllm_tp.py::test_tp1_stores_and_a_fresh_tp2_reuses_it_token_for_token",
         "test_vllm_tp.py::test_tp2_stores_and_a_fresh_tp4_reuses_it_token_for_token",
         "test_vllm_tp.py::test_tp4_stores_and_a_fresh_tp2_reuses_it_token_for_token",
         "test_vllm_tp.py::test_kvstore_engine_reuses_what_vllm_tp2_stored_and_the_reverse",
         "test_tp_shards.py::test_a_chunk_saved_at_tp2_is_the_tp1_chunk_and_loads_at_tp1_and_tp4")),
    Row("`pipeline_parallel_size` > 1", "supported",
        "each stage stores and loads its own layers (keys derived from the chunk keys and the stage's layers: "
        "reused by an engine with the same stages); the scheduler asks for every stage's keys in one lookup. "
        "Shown without vLLM: vLLM CPU 0.32 itself fails PP=2 at its first request (`assert "
        "self.intermediate_tensors is not None`, with or without a connector)",
        ("test_tp_shards.py::test_pp_stages_store_their_own_layers_and_a_lookup_needs_every_stage",)),
    Row("`--dtype` bfloat16 / float16 / float32 (KV cache `auto`)", "supported",
        "the same chunk keys as `kvstore-engine` for the same model directory",
        ("test_vllm_config.py::test_vllm_and_kvstore_engine_compute_one_fingerprint", "test_vllm_cross_engine.py")),
    Row("`--kv-cache-dtype` fp8 / fp8_e4m3 / fp8_e5m2", "supported",
        "moved as they are (vLLM hands the cache over as uint8; stored as the fp8 format, raw); the format and a "
        "digest of the layers' per-tensor k/v scales are in the layout, so an engine with other scales or the "
        "other format misses; each worker checks at startup that its layers use the scales the keys were made for",
        ("test_vllm_fp8.py::test_fp8_stored_by_one_vllm_is_reused_by_a_fresh_one_at_tp2",
         "test_vllm_fp8.py::test_another_format_other_scales_or_another_model_is_a_miss_never_a_load")),
    Row("any other `--kv-cache-dtype` (fp8_inc, *_per_token_head, nvfp4, turboquant_*, ...)", "refused",
        _msg(CACHE_DTYPE, dtype="int8_per_token_head", choices=", ".join(PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES)),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("`chunk_size` not a multiple of the block size", "refused", "a `ConfigError` from the connector's settings",
        ("test_vllm_config.py::test_what_the_connector_cannot_serve_is_refused_at_startup",)),
    Row("MLA (DeepSeek / Kimi / GLM latent KV)", "supported",
        "the latent (kv_lora_rank + qk_rope_head_dim per token and layer) is stored once, raw, whatever the TP "
        "size, and every rank loads all of it (vLLM CPU's AMX MLA backend: a store hit answers exactly as "
        "vLLM's own prefix-cache hit)",
        ("test_vllm_mla.py::test_mla_at_tp2_a_fresh_vllm_reuses_what_another_stored",
         "test_vllm_mla.py::test_mla_at_tp1_a_fresh_vllm_reuses_what_another_stored_and_what_cpu_mla_saved",
         "test_vllm_mla.py::test_mla_tp1_stores_the_same_bytes_as_tp2")),
    Row("MLA on vLLM CPU's reference CPU_MLA backend (vLLM turns its prefix caching off)", "runs, no reuse",
        "saves only, no hits, one log line: that backend's prefill does not attend over a prefix it did not "
        "compute (what it saves is a hit for an AMX MLA engine)",
        ("test_vllm_mla.py::test_mla_on_vllms_cpu_mla_backend_saves_and_reports_no_hits",)),
    Row("MLA with a `codec` other than raw", "refused", _msg(MLA_CODEC, codec="int4"),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("sliding-window layers (Gemma-3, Mistral), vLLM's hybrid KV cache manager on", "supported",
        "`SupportsHMA`: a block table per KV cache group; a window layer's blocks out of its window stay free "
        "(vLLM's memory savings kept) and a load fills only its window; a failed load fails its request whole "
        "(recomputed): loads are asynchronous for such a model",
        ("test_vllm_hybrid.py::test_a_sliding_window_model_with_the_hybrid_manager_reuses_a_prompt",)),
    Row("a sliding window that is not a multiple of the block size", "refused", _msg(WINDOW, window=100, block=128),
        ("test_vllm_support.py::test_each_refusal_comes_before_vllm_starts_anything",)),
    Row("Mamba / linear-attention hybrids (Jamba, Bamba, LFM2, Qwen3.5, ...)", "runs, no reuse",
        "vLLM starts with its hybrid manager; the connector reports no hits and saves nothing for the model "
        "(kvstore does not store Mamba / linear-attention state), and says so in one log line",
        ("test_vllm_hybrid.py::test_a_mamba_style_hybrid_starts_and_answers_with_no_store_hits",)),
    Row("asynchronous loads (`load_async`, default true)", "supported",
        "a request loads between steps while others keep running; a failed chunk's blocks are recomputed "
        '(`"load_async": false` loads inside the step, before the forward)',
        ("test_vllm_scheduler.py::test_an_async_load_is_asked_once_and_vllms_second_allocation_counts_nothing",
         "test_vllm_store.py::test_a_corrupt_chunk_is_recomputed_with_identical_output")),
    Row("vLLM's connector observability", "supported",
        "`get_kv_connector_stats` / `build_prom_metrics` (`vllm:kvstore_*` in vLLM's /metrics, with a `tier` "
        "label), `CacheHitSource` (host / disk / unspecified from the store's tiers), `take_events` (BlockStored / "
        "BlockRemoved, medium `kvstore`), `reset_cache`",
        ("test_vllm_store.py::test_kvstores_loads_and_saves_are_in_vllms_own_metrics",
         "test_vllm_stats.py::test_stats_are_deltas_summed_over_workers_and_reach_prometheus",
         "test_vllm_stats.py::test_kv_events_are_vllms")),
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
    settings = KVTransferConfig.from_mapping(extra)
    if settings.is_local:
        return NO_SERVER
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype not in PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES:
        return _msg(CACHE_DTYPE, dtype=cache_dtype, choices=", ".join(PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES))
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "use_mla", False) and settings.codec != "raw":
        return _msg(MLA_CODEC, codec=settings.codec)
    window = getattr(getattr(mc, "hf_text_config", None), "sliding_window", None)
    hma_off = getattr(getattr(vllm_config, "scheduler_config", None), "disable_hybrid_kv_cache_manager", None)
    if (
        isinstance(window, int)
        and isinstance(block_size, int)
        and window % block_size
        and hma_off is not True
    ):
        return _msg(WINDOW, window=window, block=block_size)
    return None


def check_supported(vllm_config: Any) -> None:
    """Raise `ConfigError` with `refusal(vllm_config)` when there is one."""
    message = refusal(vllm_config)
    if message is not None:
        raise ConfigError(message)
