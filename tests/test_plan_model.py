"""Hugging Face config -> ModelSpec: parameter counts match the published models, presets still work."""

import json
from pathlib import Path

import pytest

from pdserve.plan.model import count_params, resolve_spec, spec_from_config
from pdserve.plan.roofline import MODELS

SMOL_CONFIG = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct/config.json"
# Qwen2.5-7B's published config.json values (q/k/v biases are implied by model_type qwen2)
QWEN_CONFIG = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.skipif(not SMOL_CONFIG.exists(), reason="SmolLM2-135M-Instruct config not downloaded")
def test_smollm2_from_real_config():
    spec = resolve_spec(str(SMOL_CONFIG.parent))
    assert spec.params == pytest.approx(134.5e6, rel=0.01)
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (30, 3, 64)
    assert spec.dtype_bytes == 4.0                      # the config says float32
    assert spec.kv_bytes_per_token == MODELS["smollm2-135m"].kv_bytes_per_token
    assert resolve_spec(str(SMOL_CONFIG), dtype="bf16").dtype_bytes == 2.0


def test_qwen25_7b_from_published_values():
    assert count_params(QWEN_CONFIG) == pytest.approx(7.615e9, rel=0.005)
    spec = spec_from_config(QWEN_CONFIG, "Qwen2.5-7B")
    preset = MODELS["qwen2.5-7b"]
    assert spec.kv_bytes_per_token == preset.kv_bytes_per_token == 57344
    assert spec.dtype_bytes == 2.0


def test_head_dim_derived_and_kv_heads_default(tmp_path):
    cfg = {**QWEN_CONFIG, "model_type": "llama"}
    del cfg["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_spec(str(tmp_path), params=7e9)
    assert (spec.kv_heads, spec.head_dim, spec.params) == (28, 128, 7e9)


def test_presets_overrides_and_errors(tmp_path):
    assert resolve_spec("qwen2.5-7b") == MODELS["qwen2.5-7b"]
    assert resolve_spec("qwen2.5-7b", dtype="fp32", params=8e9).dtype_bytes == 4.0
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_spec("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_CONFIG, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        resolve_spec(str(tmp_path))
    granite4 = {**QWEN_CONFIG, "model_type": "granitemoehybrid", "num_local_experts": 0,
                "shared_intermediate_size": 1024, "position_embedding_type": "rope"}
    (tmp_path / "config.json").write_text(json.dumps({**granite4, "layer_types": ["mamba", "attention"] * 14}))
    with pytest.raises(ValueError, match="Mamba layers"):       # a hybrid's Mamba layers are not priced
        resolve_spec(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**granite4, "layer_types": ["attention"] * 28}))
    assert resolve_spec(str(tmp_path)).experts == 0
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_spec(str(tmp_path))


def test_every_tiny_arch_is_counted_exactly(tmp_path):
    """count_params against the real parameter count of each architecture the engine runs (tiny
    random models: q/k norms of qwen3 and olmo2, phi3's fused projections, granite, smollm3; and
    Seed-OSS-36B's biases, on q/k/v but not o_proj)."""
    from transformers import AutoModelForCausalLM

    from tiny_models import TINY_ARCHS, tiny_model_dir
    seed_oss = {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}
    for arch, overrides in [(arch, None) for arch in TINY_ARCHS] + [("seed_oss", seed_oss)]:
        path = tiny_model_dir(tmp_path / f"{arch}-{bool(overrides)}", arch, seed=0, head_dim=32, overrides=overrides)
        model = AutoModelForCausalLM.from_pretrained(path)
        assert resolve_spec(str(path)).params == sum(p.numel() for p in model.parameters()), arch


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "mistral", "sliding_window": 4096}, (4096, 8)),                       # every layer
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, (0, 0)),   # off
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2},
     (4096, 6)),                                                                          # from layer 2
    ({"model_type": "gemma3_text", "sliding_window": 512}, (512, 7)),                     # 5 local : 1 global
    ({"model_type": "gemma2", "sliding_window": 4096}, (4096, 4)),                        # every other layer
    ({"model_type": "llama"}, (0, 0)),
    ({"model_type": "not-in-transformers", "sliding_window": 100}, (100, 8)),             # as its keys say
])
def test_the_sliding_window_is_read_as_the_engine_reads_it(config, expected):
    cfg = {**QWEN_CONFIG, "num_hidden_layers": 8, **config}
    spec = spec_from_config(cfg, "m")
    assert (spec.window, spec.window_layers) == expected
    assert spec.kv_bytes_per_token == spec_from_config(QWEN_CONFIG | {"num_hidden_layers": 8}, "m").kv_bytes_per_token
