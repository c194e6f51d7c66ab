"""Load a Hugging Face checkpoint directory (safetensors, sharded or not) into the engine's model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from kvstore.engine.config import ModelConfig, parse_dtype
from kvstore.engine.errors import ModelLoadError
from kvstore.engine.layers import cpu_lib
from kvstore.engine.layers.linear import default_weight_loader
from kvstore.engine.models import MODEL_REGISTRY
from safetensors import SafetensorError, safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Checkpoint tensors the engine has no use for (precomputed RoPE tables in old Llama checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{model_dir} lacks weight shards {missing}")
    return files


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; every parameter must be set."""
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding's name
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    tensor = f.get_tensor(name)
                    target, shard_id = name, None
                    for ckpt_name, (fused_name, sid) in packed.items():
                        if f".{ckpt_name}." in name:
                            target, shard_id = name.replace(f".{ckpt_name}.", f".{fused_name}."), sid
                            break
                    if name == "lm_head.weight" and target not in params:
                        continue  # tied embeddings, but the checkpoint still carries a copy
                    param = params.get(target)
                    if param is None:
                        raise ModelLoadError(f"{path.name}: unexpected tensor {name!r}")
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    try:
                        with torch.no_grad():
                            loader(param, tensor.to(param.dtype), shard_id)
                    except ValueError as e:
                        raise ModelLoadError(f"{path.name}: {name}: {e}") from e
                    loaded.add(f"{target}#{shard_id}")
        except (OSError, SafetensorError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    expected = set()
    for pname in params:
        shards = [sid for fused, sid in packed.values() if f".{fused}." in f".{pname}"]
        expected |= {f"{pname}#{sid}" for sid in shards} if shards else {f"{pname}#None"}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    model_name: str | None = None,
    use_cpu_kernels: bool | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `model_dir/config.json`, load its weights, cast to `dtype` (default: the
    checkpoint's dtype), move it to `device` and put it in eval mode. `use_cpu_kernels` (default: on
    a CPU where `cpu_lib.available()`) lets the layers repack for the C kernels (models/llama.py)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir, model_name=model_name)
    dtype = parse_dtype(dtype, config.dtype)
    cls = MODEL_REGISTRY[config.model_type]
    model = cls(config)  # parameters start uninitialised (torch.empty): every one is loaded below
    load_weights(model, model_dir)
    model = model.to(device=device, dtype=dtype).eval()
    if use_cpu_kernels is None:
        use_cpu_kernels = torch.device(device).type == "cpu" and cpu_lib.available()
    model.process_weights_after_loading(use_cpu_kernels)
    logger.info("loaded %s (%s, %s) from %s", config.model_name, config.model_type, dtype, model_dir)
    return model, config
