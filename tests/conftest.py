from __future__ import annotations

import os

import pytest

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _offline_model(alias: str):
    """(model_fp32, tokenizer) of an offline alias, or skip when its packages are absent."""
    from kvboost_rag.errors import MissingModelPackageError
    from kvboost_rag.models import load_model

    try:
        return load_model(alias, dtype="float32")
    except MissingModelPackageError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2():
    """(model_fp32, tokenizer) of the offline SmolLM2-135M-Instruct."""
    return _offline_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3():
    """(model_fp32, tokenizer) of the offline Gemma 3 270M."""
    return _offline_model("gemma3-270m")
