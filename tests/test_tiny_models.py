"""Tests for the test helper tests/tiny_models.py: tiny random models load, run and are seeded."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.models import ModelError
from tiny_models import TINY_ARCHS, tiny_model_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_loads_and_runs(tmp_path, arch):
    path = tiny_model_dir(tmp_path / arch, arch, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 2
    assert model.config.tie_word_embeddings == (arch != "mistral")
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    rng_before = torch.random.get_rng_state()
    weights = [load_file(tiny_model_dir(tmp_path / name, "qwen2", seed=seed) / "model.safetensors")
               for name, seed in [("a", 0), ("b", 0), ("c", 1)]]
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_tiny_llama_fixture_uses_the_default_tokenizer(tiny_llama_dir, default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)
    reference = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert len(tokenizer) == len(reference) == 49152
    assert tokenizer.chat_template == reference.chat_template
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True)
    assert model.config.vocab_size == 49152 and model.generation_config.eos_token_id == reference.eos_token_id
    assert sum(p.numel() for p in model.parameters()) < 4_000_000


def test_unknown_tiny_arch(tmp_path):
    with pytest.raises(ModelError, match="llama, qwen2, mistral"):
        tiny_model_dir(tmp_path, "gpt-neox")
