"""The engine's exception hierarchy. The OpenAI server maps `status` to the HTTP code."""

from __future__ import annotations

from http import HTTPStatus


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
    """A request the engine cannot serve: bad sampling params, prompt too long, unknown model...
    `param` names the request field at fault (the OpenAI error's `param`) when one is."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidRequest):
    """A request for a model this server does not serve."""

    status = 404


class RequestFailed(EngineError):
    """A request the engine accepted but could not finish (a fault inside its step, a shutdown)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class KVBackendUnavailable(EngineError):
    """A `--kv-backend` that is not available in this build."""

    status = 400


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI error shape every server of the engine answers with."""
    try:
        kind = HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    except ValueError:
        kind = "Client" if 400 <= status < 500 else "Server"
    kind = kind if kind.endswith("Error") else kind + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
