"""Fixtures the project-wide tests borrow from the rooms' test folders."""

from tests.engine.conftest import smollm2_dir  # noqa: F401 (the converted SmolLM2, a session fixture)
