"""One request as the scheduler sees it: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvstore.engine.outputs import TokenLogprobs
    from kvstore.engine.structured_output.request import StructuredOutputRequest
    from kvstore.engine.tokenizer import IncrementalDecoder


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, KV arriving from the store
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)  # identity, not field-by-field comparison
class Sequence:
    """A request. `num_computed_tokens` counts tokens whose K/V sit in `block_table`'s blocks.

    `block_hashes[i]` is the chained hash of full block i (prompt and generated tokens alike); it is
    extended lazily as blocks fill, so it never has to be recomputed after a preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on first scheduling
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    output_text: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # set when the engine gave up on it (a fault in its step)
    structured_output: StructuredOutputRequest | None = None  # the grammar state, when constrained
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when sampling_params.logprobs
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # [i]: prompt token i's
    detokenizer: IncrementalDecoder | None = None  # output_text while it runs (engine._detokenize)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a sequence needs at least one prompt token"
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
