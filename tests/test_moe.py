"""Mixture-of-experts models (engine/moe.py): tiny random Mixtral, Qwen2-MoE (a shared expert and
a dense layer), Qwen3-MoE, OLMoE, Granite MoE (3.0; 3.1's with a shared MLP; Granite 4.0's
attention-only layout with experts), ERNIE 4.5 MoE (fp32 routing with a correction bias, a shared
expert, a dense first layer), their routers sharpened and experts strengthened so that
which experts a token runs, and with what weight, decides its output.

- In fp32 the engine's greedy tokens are Hugging Face `generate`'s and its log-probabilities the
  transformers forward's within fp32's rounding; in bf16 (the CPU kernels) within bf16's (a token
  whose top-k is a near tie may take another expert there, as transformers' own bf16 would).
- int8 and int4 experts run, prompts chunked, and every KV block comes back (with every other
  architecture: tests/test_weight_formats.py).
- LoRA adapters on a mixture's MLPs are refused (on its attention projections they load).
- The planner (`pdserve plan`, `simulate`, the SLO policy's model) counts the experts and prices
  a step by the experts its tokens read.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora_config import plan
from engine.model_runner import _dequantized
from engine.model_dims import Dims
from engine.sampling_params import SamplingParams
from logprob_compare import engine_logprobs, hf_logprobs
from tiny_models import TINY_MOE_ARCHS, tiny_model_dir

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], list(range(50, 260, 10))]
# Granite 4.0's layout (granitemoehybrid, attention-only) with experts beside its shared MLP
GRANITE4_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "shared_intermediate_size": 64}


def _moe_model(tmp_path, arch: str):
    """A tiny `arch` whose router weights are 20x (each token's choice clear-cut, its weights far
    from even) and expert weights 4x (their output outweighs the residual); Qwen2-MoE's shared
    expert 4x too, its gate random (a fresh one is near zero: the gate would sit at 0.5),
    Granite's ungated shared MLP as it is (its output adds to the experts'), and ERNIE's correction
    bias random (a fresh one is zero), large enough to change which experts some tokens pick; gpt-oss's
    attention sinks, router bias and expert biases random (fresh: near zero, zero, zero), the gate and
    up projections' biases large enough that its SwiGLU's clamps bite."""
    overrides = GRANITE4_MOE if arch == "granitemoehybrid" else None
    path = tiny_model_dir(tmp_path / arch, arch, seed=5, head_dim=64, overrides=overrides)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for layer in model.model.layers:
            mlp = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
            if hasattr(mlp, "experts"):
                router = mlp.gate if hasattr(mlp, "gate") else mlp.router
                router.weight.mul_(20)
                if hasattr(router, "moe_statics"):
                    router.moe_statics.e_score_correction_bias.normal_(0, 0.3)
                if hasattr(router, "e_score_correction_bias"):        # glm4_moe's
                    router.e_score_correction_bias.normal_(0, 0.3)
                mlp.experts.gate_up_proj.mul_(4)
                mlp.experts.down_proj.mul_(4)
                if arch == "gpt_oss":
                    router.bias.normal_(0, 2)
                    mlp.experts.gate_up_proj_bias.normal_(0, 8)     # beyond the SwiGLU's clamp at 7
                    mlp.experts.down_proj_bias.normal_(0, 1)
                    layer.self_attn.sinks.normal_(0, 2)
            if getattr(mlp, "shared_expert", None) is not None:
                mlp.shared_expert_gate.weight.normal_(0, 1)
                for proj in (mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj, mlp.shared_expert.down_proj):
                    proj.weight.mul_(4)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", TINY_MOE_ARCHS + ("granitemoehybrid",))
def test_mixtures_of_experts_give_the_hf_models_tokens_and_logprobs(tmp_path, arch, dtype):
    path = _moe_model(tmp_path, arch)
    # transformers' eager expert loop, the reference the engine's op order follows
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB",
                                 block_size=4, max_num_batched_tokens=16))
    layers = eng.runner.model.layers
    # qwen2_moe's second layer is dense, ernie4_5_moe's and glm4_moe's first
    assert [layer.moe is not None for layer in layers] == {"qwen2_moe": [True, False], "ernie4_5_moe": [False, True],
                                                           "glm4_moe": [False, True]}.get(arch, [True, True])
    assert eng.runner.model.moe and eng.runner.loras.dims.moe
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    # each prompt alone (decode steps of one token: MoeMlp's one-token path) and both in one batch
    done = [eng.generate([prompt], params)[0] for prompt in PROMPTS]
    batched = eng.generate(PROMPTS, params)
    diffs = torch.cat([(engine_logprobs(d) - hf_logprobs(hf, p, d)).abs() for p, d in zip(PROMPTS, done)])
    diffs = torch.cat([diffs, *[(engine_logprobs(d) - hf_logprobs(hf, p, d)).abs() for p, d in zip(PROMPTS, batched)]])
    if dtype == "float32":
        assert diffs.max() < 1e-4, diffs.max()
        assert [d.token_ids for d in batched] == [d.token_ids for d in done]
        hf.generation_config.eos_token_id = None
        for prompt, d in zip(PROMPTS, done):
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, pad_token_id=0)
            assert d.token_ids == out[0, len(prompt):].tolist()
    else:       # measured: max 0.004-0.007, 0.07 in one OLMoE prompt (a near tie); means below 0.002
        assert diffs.max() < 0.2 and diffs.mean() < 0.01, (diffs.max(), diffs.mean())
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def _as_mxfp4(path):
    """The tiny gpt_oss at `path` rewritten as gpt-oss is released: each expert projection as MXFP4
    (`*_blocks`, two FP4 values a byte in blocks of 32, and `*_scales`, a power of two a block;
    random here, scales 2^-5 .. 2^0) and a quantization_config naming the modules left unquantized."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(name).shape                  # [E, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(122, 128, (experts, n_out, n_in // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_gpt_oss_checkpoint_in_mxfp4_loads_dequantized(tmp_path):
    """gpt-oss's release format: its experts in MXFP4, which transformers dequantizes at the engine's
    load (engine.model_runner asks it to, so that its packed kernels' layout never reaches the
    engine); the greedy tokens are those of Hugging Face's dequantized model, in every weight
    format the engine's experts take."""
    from transformers import Mxfp4Config
    path = _as_mxfp4(tiny_model_dir(tmp_path / "mx", "gpt_oss", seed=5, head_dim=64))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    hf.generation_config.eos_token_id = None
    # asked for even where transformers' MXFP4 kernels are installed (here they are not: it would
    # dequantize anyway)
    assert _dequantized(str(path))["quantization_config"].dequantize
    assert _dequantized(str(tiny_model_dir(tmp_path / "plain", "gpt_oss", seed=5, head_dim=64))) == {}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for dtype, quantization in (("float32", None), ("bfloat16", "int8")):
        eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB",
                                     block_size=4, quantization=quantization))
        for prompt, done in zip(PROMPTS, eng.generate(PROMPTS, params)):
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, pad_token_id=0)
            if quantization is None:
                assert done.token_ids == out[0, len(prompt):].tolist()
            else:      # int8 experts in bf16: the first tokens agree (later ones may part at a near tie)
                assert done.token_ids[:2] == out[0, len(prompt):len(prompt) + 2].tolist()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_lora_on_a_mixtures_mlps_is_refused_and_on_its_attention_planned():
    config = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "num_local_experts": 4}
    dims = Dims.of_config(config)
    assert dims.moe and not Dims.of_config({**config, "num_local_experts": None}).moe
    attention = {"model.layers.0.self_attn.q_proj.lora_A.weight": (8, 64),
                 "model.layers.0.self_attn.q_proj.lora_B.weight": (64, 8)}
    parts = plan(attention, dims)
    assert [(p.layer, p.linear, p.rank) for p in parts] == [(0, "qkv", 8)]
    mlp = {"model.layers.1.mlp.gate_proj.lora_A.weight": (8, 64), "model.layers.1.mlp.gate_proj.lora_B.weight": (32, 8)}
    assert "mixture-of-experts" in plan({**attention, **mlp}, dims)
    assert isinstance(plan(mlp, Dims.of_config({**config, "num_local_experts": None})), list)    # dense: planned


def test_the_planner_counts_a_mixtures_experts_and_prices_the_ones_a_step_reads(tmp_path):
    """`pdserve plan`'s spec of each tiny mixture counts transformers' parameters exactly, its
    routed experts' too; a token computes with the active ones; a decode step of one sequence reads
    the dense part and k of E experts a layer, a large batch nearly all of them; the SLO policy's
    per-replica model (serve_config.slo_policy) carries the same."""
    from pdserve.plan.model import resolve_spec
    from pdserve.serve_config import slo_policy
    from serving.config import AppConfig
    from serving.slo_model import StepModel
    for arch in TINY_MOE_ARCHS + ("granitemoehybrid",):
        overrides = GRANITE4_MOE if arch == "granitemoehybrid" else None
        path = tiny_model_dir(tmp_path / arch, arch, seed=0, head_dim=32, overrides=overrides)
        model = AutoModelForCausalLM.from_pretrained(path)
        spec = resolve_spec(str(path))
        assert spec.params == sum(p.numel() for p in model.parameters()), arch
        routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        assert (spec.expert_params, spec.experts, spec.experts_per_token) == (routed, 4, 2), arch
        dense = spec.params - routed
        assert spec.active_params == dense + routed / 2 == spec.step_params(1), arch
        assert spec.step_params(1) < spec.step_params(2) < spec.step_params(8) < spec.params, arch
        assert spec.step_params(64) == pytest.approx(spec.params), arch
    cfg = AppConfig.model_validate({"model": str(path), "autoscaling": {"ttft_slo": 1.0, "tpot_slo": 0.1,
                                                                        "hardware": "h100"}})
    step = StepModel(**slo_policy(cfg)["policy_kwargs"]["model"])
    assert (step.experts, step.experts_per_token) == (4, 2) and step.params == spec.active_params
    assert step.step_weight_bytes(1) < step.step_weight_bytes(8) < step.weight_bytes
    assert step.step_weight_bytes(1) / step.weight_bytes == pytest.approx(spec.active_params / spec.params)
