"""The engine's KV transfer (`--kv-backend kvstore`, docs/design.md §5): the scheduler-side and
worker-side KV connectors made from the engine's settings, and what the step loop does with them
after each step — hand over the last KV of finished requests, then free the blocks of finished saves
and resume the requests whose loads landed. The scheduler holds the scheduler side
(`Scheduler.connector`: lookups, load/save plans), the model runner the worker side
(`ModelRunner.connector`: the loads and saves themselves)."""

from __future__ import annotations

import logging
import sys

import torch
from kvstore.connectors.base import KVConnectorBase, KVConnectorRole
from kvstore.connectors.factory import create_connector
from kvstore.engine.config import ModelConfig
from kvstore.engine.engine_args import EngineArgs
from kvstore.engine.errors import KVBackendUnavailable
from kvstore.engine.kv_cache.fp8_scales import KVScales
from kvstore.engine.model_runner import ModelRunner
from kvstore.engine.scheduler import Scheduler, SchedulerOutput

from kvstore.errors import KVStoreError
from kvstore.keys import model_layout

logger = logging.getLogger(__name__)

GIL_SWITCH_S = 0.001  # sys.setswitchinterval with a KV connector (see make_kv_connectors)
IDLE_WAIT_S = 0.05  # a step with nothing to compute waits this long at most for a KV load to land


def make_kv_connectors(
    args: EngineArgs, cfg: ModelConfig, kv_cache_dtype: torch.dtype, kv_scales: KVScales | None
) -> tuple[KVConnectorBase | None, KVConnectorBase | None]:
    """The scheduler-side and worker-side connectors, sharing one store connection; (None, None) for
    `--kv-backend none`. A store that cannot be used is a KVBackendUnavailable."""
    if args.kv_backend == "none":
        return None, None
    # Only what the user set: the connector layers it over KVSTORE_* environment variables.
    config = {
        **args.kv_connector_extra_config, "kv_role": args.kv_role, "block_size": args.block_size,
        # kvstore.keys.model_layout: the same fingerprint as every other engine (vLLM's connector)
        "layout": model_layout(
            cfg.raw, model=cfg.model_name, kv_dtype=str(kv_cache_dtype),
            kv_scales=kv_scales.digest() if kv_scales is not None else "",
        ),
    }  # fmt: skip
    try:
        scheduler_side = create_connector(args.kv_backend, KVConnectorRole.SCHEDULER, config)
        try:
            worker_side = create_connector(args.kv_backend, KVConnectorRole.WORKER, config)
        except BaseException:
            scheduler_side.shutdown()
            raise
    except KVStoreError as e:
        raise KVBackendUnavailable(f"--kv-backend {args.kv_backend}: {e}") from e
    c = scheduler_side.config
    logger.info("KV connector: %s, store %s, codec %s, role %s", args.kv_backend, c.store_url, c.codec,
                c.kv_role)  # fmt: skip
    # The engine thread takes the GIL back after every kernel call; while the connector's save and
    # load threads run Python it waits up to the switch interval each time (default 5 ms; measured
    # on the short-turn chat: decode steps 2-4 ms slower with the store on). 1 ms bounds that wait.
    if sys.getswitchinterval() > GIL_SWITCH_S:
        sys.setswitchinterval(GIL_SWITCH_S)
    return scheduler_side, worker_side


def finish_kv_transfers(scheduler: Scheduler, runner: ModelRunner, kv_producer: bool, stepped: bool) -> None:
    """After a step: hand over the last KV of requests finished this step, then free the blocks of
    those whose save is done and resume those whose asynchronous load is done. `kv_producer` (a
    prefill instance) flushes the saves of finished requests before they are answered; `stepped` is
    whether the step computed anything (if not, wait a little for a load to land)."""
    worker = runner.connector
    if worker is None:
        return
    errors = set(runner.invalid_block_ids)
    finished = scheduler.take_finished_req_ids()
    if finished:  # their trailing partial chunk is saved now, while the blocks are still theirs
        runner.execute_kv_transfers(scheduler.connector.build_connector_meta(SchedulerOutput()))
        errors |= runner.invalid_block_ids
    if finished and kv_producer:
        worker.flush()  # a prefill instance answers only once the decode instance can load the KV
    if not stepped and scheduler.loading:  # nothing to compute until a load lands: wait for it
        worker.wait_for_finished(IDLE_WAIT_S)
    done, loaded = worker.get_finished(finished)
    errors |= worker.get_block_ids_with_load_errors()  # after get_finished: covers every load it reports
    if done:
        scheduler.finish_saves(done)
    if loaded or (errors and scheduler.loading):
        scheduler.finish_loads(loaded or set(), errors)
