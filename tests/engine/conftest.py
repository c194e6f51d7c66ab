"""Shared engine fixtures: tiny random HF checkpoints and the real SmolLM2 directory.

The tiny checkpoints have PERTURBED biases and norm weights (std ~0.08): with the default init (bias 0,
norm 1) a model that forgets a bias or a norm weight would still match Hugging Face.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_ARCHS = ("llama", "qwen2", "mistral")


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        # head_dim 32 != hidden / heads (16): checks that head_dim is read, not derived.
        return transformers.LlamaConfig(
            **common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            **{**common, "tie_word_embeddings": True},
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "mistral":
        # A window smaller than the test sequences, so that ignoring it shows.
        return transformers.MistralConfig(
            **common, sliding_window=7, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}
        )
    raise ValueError(arch)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.08)
            elif p.dim() == 2:
                # Larger weights than the 0.02 init: sharper attention, so position bugs show.
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def make_tiny_checkpoint(arch: str, out: Path, seed: int = 0) -> Path:
    import transformers

    config = _tiny_config(arch)
    torch.manual_seed(seed)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]
    model = cls(config).to(torch.float32).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """`{arch: model_dir}` for tiny llama / qwen2 / mistral checkpoints."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_checkpoint(arch, root / arch, seed=i) for i, arch in enumerate(TINY_ARCHS)}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF directory (converted once, cached in ~/.cache/kvstore)."""
    from kvstore.engine.convert import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_checkpoints, smollm2_dir, tmp_path_factory) -> Path:
    """The tiny llama checkpoint with SmolLM2's tokenizer (ids below 320 decode fine): for engine,
    CLI and server mechanics that need a tokenizer but not a real model."""
    import shutil

    out = tmp_path_factory.mktemp("tiny_engine") / "tiny-llama"
    shutil.copytree(tiny_checkpoints["llama"], out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


class PagedKV:
    """A hand-built stand-in for the runner in model-level tests: one KV cache tensor, blocks handed
    out from a shuffled free list (so block tables are never contiguous), and `step()` building the
    varlen-paged inputs for a batch of `(seq_id, new_token_ids)`."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int = 64,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module, **kw) -> PagedKV:
        cfg = model.config
        kv = cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, **kw)
        kv.attach(model)
        return kv

    def attach(self, model: torch.nn.Module) -> None:
        modules = [m for m in model.modules() if hasattr(m, "kv_cache")]
        assert len(modules) == self.kv_cache.shape[0]
        for layer, m in enumerate(modules):
            m.kv_cache = self.kv_cache[layer]

    def step(self, batch: list[tuple[int, list[int]]]):
        from kvstore.engine.attention_metadata import AttentionMetadata

        bs = self.block_size
        ids, positions, slots, cu, ctx = [], [], [], [0], []
        for seq_id, tokens in batch:
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * bs < end:
                table.append(self.free.pop())
            self.lens[seq_id] = end
            ids += tokens
            for p in range(start, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            cu.append(cu[-1] + len(tokens))
            ctx.append(end)
        width = max(len(self.tables[s]) for s, _ in batch) + 1  # one extra -1 column of padding
        tables = torch.full((len(batch), width), -1, dtype=torch.int32)
        for i, (s, _) in enumerate(batch):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            max_q_len=max(len(t) for _, t in batch),
            max_context_len=max(ctx),
            block_size=bs,
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
        )


@pytest.fixture
def paged_kv() -> type[PagedKV]:
    return PagedKV


@pytest.fixture
def single_thread():
    """One intra-op thread for the duration of a test: on the shared 2-core box, two threads
    contending with other processes make torch ops 10x slower or worse (measured: 10-200x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_engine_dir(out: Path) -> Path:
    """A tiny llama checkpoint with a real (trained, byte-level BPE) tokenizer and a chat template:
    an engine directory for mechanics tests (the server, faults, aborts) that starts in a second."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    make_tiny_checkpoint("llama", out)
    vocab = _tiny_config("llama").vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2: the config's bos 1 / eos 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = "The quick brown fox jumps over the lazy dog. Once upon a time there was a tiny model. " * 50
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() <= vocab
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_bpe_engine_dir(tmp_path_factory) -> Path:
    return make_tiny_engine_dir(tmp_path_factory.mktemp("tiny_engine") / "llama")
