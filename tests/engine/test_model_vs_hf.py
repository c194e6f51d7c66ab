"""The paged model against Hugging Face transformers (eager attention, fp32) as the reference.

Tiny random llama / qwen2 / mistral checkpoints (perturbed biases and norms) are compared logit by
logit for a single prefill, a chunked prefill over a partially filled cache, decode steps and mixed
batches, with block sizes 4 and 16 and shuffled (non-contiguous) block tables. The real SmolLM2 is
checked on one prompt: prefill logits and 32 greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from kvstore.engine.loader import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-4


def _hf_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def pair(request, tiny_checkpoints):
    """(our model, HF model, arch) for one tiny checkpoint."""
    model_dir = tiny_checkpoints[request.param]
    model, _ = load_model(model_dir)
    return model, _hf_model(model_dir), request.param


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _run(model, kv, batch):
    ids, pos, meta = kv.step(batch)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, meta)), meta


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block_size", [4, 16])
def test_single_prefill(pair, paged_kv, block_size: int) -> None:
    model, hf, _ = pair
    kv = paged_kv.for_model(model, num_blocks=32, block_size=block_size)
    tokens = _tokens(37, 1, model.config.vocab_size)
    logits, _ = _run(model, kv, [(0, tokens)])
    ref = _hf_logits(hf, tokens)
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)
    assert ref.std() > 0.3  # the reference is not flat: the comparison means something


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(pair, paged_kv, block_size: int) -> None:
    model, hf, _ = pair
    kv = paged_kv.for_model(model, num_blocks=32, block_size=block_size)
    tokens = _tokens(41, 2, model.config.vocab_size)
    ref = _hf_logits(hf, tokens)
    start = 0
    for chunk in (5, 11, 2, 13):  # chunks that start and end mid-block
        logits, _ = _run(model, kv, [(0, tokens[start : start + chunk])])
        torch.testing.assert_close(logits, ref[start : start + chunk], atol=TOL, rtol=0)
        start += chunk
    for p in range(start, len(tokens)):  # decode with teacher forcing
        logits, meta = _run(model, kv, [(0, [tokens[p]])])
        assert meta.is_decode
        torch.testing.assert_close(logits[0], ref[p], atol=TOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches(pair, paged_kv, block_size: int) -> None:
    """Sequences prefilling (from scratch and on top of cached KV) next to sequences decoding."""
    model, hf, _ = pair
    kv = paged_kv.for_model(model, num_blocks=48, block_size=block_size)
    vocab = model.config.vocab_size
    seqs = {i: _tokens(n, 10 + i, vocab) for i, n in enumerate((26, 19, 33, 20))}
    refs = {i: _hf_logits(hf, t) for i, t in seqs.items()}
    done = dict.fromkeys(seqs, 0)

    def step(plan: dict[int, int]) -> None:
        batch = [(i, seqs[i][done[i] : done[i] + n]) for i, n in plan.items()]
        assert all(len(t) == plan[i] for i, t in batch)
        logits, _ = _run(model, kv, batch)
        row = 0
        for i, n in plan.items():
            torch.testing.assert_close(
                logits[row : row + n], refs[i][done[i] : done[i] + n], atol=TOL, rtol=0
            )
            done[i] += n
            row += n

    step({0: 9, 1: 6})  # two prefills
    step({0: 1, 1: 8, 2: 14})  # a decode, a chunk on a partial cache, a fresh prefill
    step({1: 1, 0: 1, 2: 1, 3: 12})  # three decodes and a prefill, rows out of seq-id order
    for _ in range(4):
        step({0: 1, 1: 1, 2: 1, 3: 1})  # pure decode batch with different context lengths
    step({2: 10, 3: 1, 0: 1})


def test_sliding_window_is_honoured(tiny_checkpoints, paged_kv) -> None:
    """Without the window the mistral logits are far off: the comparisons above can fail."""
    model, config = load_model(tiny_checkpoints["mistral"])
    assert all(w == 7 for w in config.sliding_windows)
    for m in model.modules():
        if hasattr(m, "sliding_window"):
            m.sliding_window = None
    kv = paged_kv.for_model(model, num_blocks=16, block_size=4)
    tokens = _tokens(30, 3, config.vocab_size)
    logits, _ = _run(model, kv, [(0, tokens)])
    ref = _hf_logits(_hf_model(tiny_checkpoints["mistral"]), tokens)
    assert (logits[10:] - ref[10:]).abs().max() > 1e-2
    torch.testing.assert_close(logits[:7], ref[:7], atol=TOL, rtol=0)  # inside the window: identical


def test_bf16_close_to_hf_bf16(tiny_checkpoints, paged_kv) -> None:
    model_dir = tiny_checkpoints["qwen2"]
    model, _ = load_model(model_dir, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    kv = paged_kv.for_model(model, num_blocks=16, block_size=16, dtype=torch.bfloat16)
    tokens = _tokens(24, 4, model.config.vocab_size)
    logits, _ = _run(model, kv, [(0, tokens[:20])])
    dec, _ = _run(model, kv, [(0, tokens[20:21])])
    assert logits.dtype == torch.float32
    ref = _hf_logits(_hf_model(model_dir, torch.bfloat16), tokens)
    ref32 = _hf_logits(_hf_model(model_dir), tokens)
    err = (torch.cat([logits, dec]) - ref[:21]).abs().max().item()
    bf16_noise = (ref - ref32).abs().max().item()  # how far bf16 HF itself is from fp32
    assert err <= max(2 * bf16_noise, 0.05), (err, bf16_noise)


# ---- the real model ----------------------------------------------------------------------------


def _chat_prompt_ids(model_dir) -> list[int]:
    from jinja2 import Environment
    from tokenizers import Tokenizer

    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    text = (
        Environment()
        .from_string(template)
        .render(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
        )
    )
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.mark.slow
def test_smollm2_prefill_and_greedy_match_hf(smollm2_dir, paged_kv) -> None:
    model, config = load_model(smollm2_dir)
    hf = _hf_model(smollm2_dir)
    prompt = _chat_prompt_ids(smollm2_dir)
    kv = paged_kv.for_model(model, num_blocks=24, block_size=16)

    logits, _ = _run(model, kv, [(0, prompt)])
    ref = _hf_logits(hf, prompt)
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)

    ours = [int(logits[-1].argmax())]
    for _ in range(31):
        step_logits, _ = _run(model, kv, [(0, [ours[-1]])])
        ours.append(int(step_logits[0].argmax()))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None)
    theirs = out[0, len(prompt) :].tolist()
    assert ours == theirs
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).decode(ours)
    assert text.startswith("The capital of France is Paris."), text


# ---- the loader ----------------------------------------------------------------------------------


def _copy_checkpoint(src, dst, edit=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    tensors = load_file(src / "model.safetensors")
    if edit:
        tensors = edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_sharded_checkpoint_loads_identically(tiny_checkpoints, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoints["llama"]
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, _ = load_model(src)
    b, _ = load_model(tmp_path / "sharded")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=name)


def test_tied_checkpoint_with_lm_head_copy(tiny_checkpoints, tmp_path) -> None:
    src = tiny_checkpoints["qwen2"]

    def add_lm_head(t):
        return t | {"lm_head.weight": t["model.embed_tokens.weight"].clone()}

    model, config = load_model(_copy_checkpoint(src, tmp_path / "m", add_lm_head))
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_proj" not in k}, "lacks"),
        (lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}, "lacks"),
        (lambda t: t | {"model.layers.0.mystery.weight": torch.zeros(2)}, "unexpected"),
        (lambda t: t | {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, "shape"),
    ],
)
def test_broken_checkpoints_raise(tiny_checkpoints, tmp_path, edit, match) -> None:
    from kvstore.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=match):
        load_model(_copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "m", edit))


def test_missing_directory_and_weights(tmp_path, tiny_checkpoints) -> None:
    from kvstore.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes((tiny_checkpoints["llama"] / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "m")


def test_model_helpers(tiny_checkpoints) -> None:
    model, config = load_model(tiny_checkpoints["llama"])
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    attn = [m for m in model.modules() if hasattr(m, "kv_cache")]
    assert len(attn) == config.num_layers  # exactly one kv_cache holder per layer (the runner relies on it)
    assert not model.training
