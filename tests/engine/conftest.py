"""Fixtures shared by the engine tests."""

import pytest

from tests.engine.builders import add_tokenizer, build_qwen3


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tied-embedding GQA checkpoint with head_dim != hidden/heads, plus a tokenizer."""
    path = tmp_path_factory.mktemp("tiny")
    model = build_qwen3(path)
    add_tokenizer(path)
    return path, model
