"""kvstore.engine.tokenizer against transformers' own fast tokenizer on the converted SmolLM2 directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvstore.engine.errors import TokenizerError
from kvstore.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = [
    "Hello world, what is the capital of France?",
    "  leading spaces and\ttabs\nnewlines",
    "numbers 2024 and 3.14159, emoji 🙂 and ünïcödé",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def theirs(smollm2_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_digits_are_split_one_by_one(ours: Tokenizer) -> None:
    ids = ours.encode("12345")
    assert len(ids) == 5 and ours.decode(ids) == "12345"


def test_chat_template_matches_transformers(ours: Tokenizer, theirs) -> None:
    for messages in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ref = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
            assert ids == list(ref)
    text = ours.apply_chat_template(MESSAGES[1:2])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_special_ids(ours: Tokenizer, smollm2_dir: Path) -> None:
    assert ours.eos_token_ids == (2,)
    assert ours.token_to_id("<|im_end|>") == 2 and ours.bos_token_id == 1
    assert ours.vocab_size == json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    assert ours.encode("<|im_end|>") == [2]


def test_errors(tmp_path: Path, ours: Tokenizer) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizerError):
        ours.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError):
        ours.encode(123)  # type: ignore[arg-type]


def test_template_errors_are_typed(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    config = {"chat_template": "{{ raise_exception('only user messages') }}", "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match="only user messages"):
        tok.apply_chat_template(MESSAGES)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(MESSAGES)


def _llama2_style_tokenizer() -> Tokenizer:
    """A Llama-2 style tokenizer (BPE with byte fallback, Metaspace, a Strip decoder) built in memory."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    pieces = ["▁", "▁the", "▁é", "the", "t", "h", "e", "é", "日", "▁ok"]
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces)})
    raw = RawTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(raw)


def test_incremental_decoding_is_the_full_decode_one_token_at_a_time(ours: Tokenizer) -> None:
    """At every token the incremental text is a prefix of the final text (a token that ends inside a
    UTF-8 character waits), and after a plain ASCII token it is the final text: byte-level BPE
    (SmolLM2, any ids) and byte-fallback Metaspace (Llama 2: pieces, specials and the byte tokens of
    whole characters), special tokens skipped or kept. Decoding all ids again at each token is no
    such prefix with byte fallback: "ü" then the first byte of "日" decode to three U+FFFD, as one
    run of bytes that is not UTF-8. (A run that never becomes UTF-8 turns into U+FFFD only once it
    is complete, so text already streamed cannot follow that, in vLLM either.)"""
    import random

    rng = random.Random(0)
    smol_pool = ours.encode("héllo 🎉 日本語 ∑ <|im_end|> x", add_special_tokens=False)
    smol_vocab = ours._tok.get_vocab_size(with_added_tokens=True)

    def smol_units() -> list[int]:
        return [rng.choice(smol_pool) if rng.random() < 0.6 else rng.randrange(smol_vocab)]

    llama = _llama2_style_tokenizer()
    llama_units = [
        [llama.token_to_id(p)] for p in ("▁", "▁the", "▁é", "the", "t", "é", "<s>", "</s>", "<unk>")
    ]
    llama_units += [[1 + b for b in ch.encode()] for ch in ("a", " ", "\n", "ü", "日", "🎉", "\x00")]
    cases = [
        (ours, smol_units, ours.encode(" ok")[-1]),
        (llama, lambda: rng.choice(llama_units), llama.token_to_id("▁ok")),
    ]
    for tok, unit, ascii_id in cases:
        for _ in range(150):
            ids = [i for _ in range(rng.randint(1, 30)) for i in unit()] + [ascii_id]
            for skip in (True, False):
                dec, full = tok.incremental_decoder(skip), tok.decode(ids, skip)
                for k in range(1, len(ids) + 1):
                    text = dec.update(ids[:k])
                    assert full.startswith(text), (ids[:k], text)
                assert text == full, ids
