"""The engine's exception hierarchy. The OpenAI server maps `status` to the HTTP code."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""

    status = 500


class ModelLoadError(EngineError):
    """A model directory that is missing, unreadable, incomplete or of an unsupported architecture."""

    status = 500


class UnsupportedModel(ModelLoadError, ValueError):
    """A config.json whose architecture / model_type the engine does not implement."""

    status = 400


class ConversionError(ModelLoadError):
    """A GGUF (or other) checkpoint that cannot be converted to an HF directory."""


class TokenizerError(EngineError):
    """A tokenizer.json / tokenizer_config.json that cannot be loaded or applied."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine cannot serve: bad sampling params, prompt too long, unknown model..."""

    status = 400


class KVBackendUnavailable(EngineError):
    """A `--kv-backend` that is not available in this build."""

    status = 400
