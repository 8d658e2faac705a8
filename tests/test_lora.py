"""LoRA adapters in the engine (engine/lora.py), against transformers with each adapted projection
run as PEFT runs it (tests/lora_adapters.py): float32 greedy output token-identical, rows of
several adapters and of the base model in one step, bf16 within its rounding; the prefix cache
keeps an adapter's K/V apart from the base model's; adapters the engine cannot serve are refused
with the reason."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.block_manager import BlockManager, chain_seed
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora_config import plan, read_adapter
from engine.model_dims import Dims
from engine.sampling_params import SamplingParams
from lora_adapters import ATTENTION, GRANITE4_MLP, MLP, with_adapter, write_adapter
from tiny_models import tiny_model_dir

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 23, 7, 200, 11], [9, 4, 150, 77, 3], list(range(30, 70, 3))]


def _greedy(model, prompt: list[int], n: int = 10) -> list[int]:
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine(path, adapters: dict, dtype="float32", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_memory="16MiB", block_size=4,
                                  lora_modules={k: str(v) for k, v in adapters.items()}, **kw))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama and two adapters: all projections at rank 4; attention only, layer 1, rank 8
    with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    path = tiny_model_dir(root / "llama", "llama", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    a = write_adapter(root / "a", hf, seed=1)
    b = write_adapter(root / "b", hf, ATTENTION, rank=8, alpha=16, seed=2, layers=[1], config={"use_rslora": True})
    return path, {"a": a, "b": b}


def _reference(path, adapter=None):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return with_adapter(hf, adapter) if adapter is not None else hf


def test_fp32_greedy_output_is_transformers_with_the_adapter_in_a_mixed_batch(tiny):
    path, adapters = tiny
    expected = {name: [_greedy(_reference(path, adapters.get(name)), p) for p in PROMPTS]
                for name in (None, "a", "b")}
    assert expected["a"] != expected[None] and expected["b"] != expected[None]     # the adapters matter
    eng = _engine(path, adapters)
    names = [None, "a", "b"]
    # every prompt under every adapter and the base model, all in the same steps
    jobs = [(p, names[(i + j) % 3]) for i, p in enumerate(PROMPTS) for j in range(3)]
    got = eng.generate([p for p, _ in jobs],
                       [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora=n) for _, n in jobs])
    for (prompt, name), done in zip(jobs, got):
        assert done.token_ids == expected[name][PROMPTS.index(prompt)], name
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("arch", ["phi3", "qwen2", "granitemoehybrid", "helium", "glm", "arcee", "starcoder2", "phi",
                                  "cohere"])
def test_other_archs_fused_projections_and_biases(tmp_path, arch):
    """phi3's checkpoints fuse qkv_proj and gate_up_proj (adapters name those), qwen2 has q/k/v
    biases, Granite 4.0's MLP is its shared_mlp's input_linear ([gate; up]) and output_linear, helium's
    RoPE on interleaved pairs reorders the engine's q/k rows (and so the adapter's B rows there; glm's
    on half of each head, its MLP's gate and up fused), arcee's ungated MLP has up_proj alone (starcoder2's
    is c_fc and c_proj, beside LayerNorms; phi's fc1 and fc2, its o_proj `dense`; cohere's RoPE on interleaved
    pairs in a block with attention and MLP side by side)."""
    path = tiny_model_dir(tmp_path / arch, arch, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    modules = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
               "granitemoehybrid": ATTENTION + GRANITE4_MLP,
               "glm": ATTENTION + ("gate_up_proj", "down_proj"),
               "arcee": ATTENTION + ("up_proj", "down_proj"),
               "starcoder2": ATTENTION + ("c_fc", "c_proj"),
               "phi": ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")}.get(arch, ATTENTION + MLP)
    adapter = write_adapter(tmp_path / "adapter", hf, modules, seed=3)
    expected = [_greedy(_reference(path, adapter), p) for p in PROMPTS]
    eng = _engine(path, {"x": adapter})
    got = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora="x"))
    assert [c.token_ids for c in got] == expected


def test_bf16_logprobs_within_rounding(tiny, tmp_path):
    """bf16 (the kernels' paths on a CPU with native bf16), an adapter whose update is the size of
    the base weights' (the fixture's are ten times that, where bf16's rounding of the inputs grows
    with them): transformers' fp32 logprobs with the adapter within bf16's rounding, and far from the
    base model's."""
    path, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = write_adapter(tmp_path / "small", hf, seed=6, scale=0.1)
    with_lora, base_ref = _reference(path, adapter), _reference(path)
    eng = _engine(path, {"s": adapter}, dtype="bfloat16", max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0, lora="s")
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = eng.generate(PROMPTS + PROMPTS, [params] * len(PROMPTS) + [base] * len(PROMPTS))
    for prompt, done in zip(PROMPTS, got):
        ids = torch.tensor([prompt + done.token_ids])
        targets = ids[0, 1:]
        with torch.no_grad():
            expected, without = (torch.log_softmax(m(ids).logits[0].float(), dim=-1)[torch.arange(len(targets)),
                                                                                       targets]
                                 for m in (with_lora, base_ref))
        mine = torch.tensor([lp.logprob for lp in [*done.prompt_logprobs, *done.logprobs]])
        assert (mine - expected).abs().max() < 0.02, (mine - expected).abs().max()
        assert (without - expected).abs().max() > 0.2


def test_the_prefix_cache_keeps_an_adapters_kv_apart(tiny):
    path, adapters = tiny
    eng = _engine(path, adapters)
    prompt = list(range(100, 140))
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    base = eng.generate([prompt], SamplingParams(**greedy))[0]
    first = eng.generate([prompt], SamplingParams(**greedy, lora="a"))[0]
    again = eng.generate([prompt], SamplingParams(**greedy, lora="a"))[0]
    other = eng.generate([prompt], SamplingParams(**greedy, lora="b"))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0     # not the base model's K/V
    assert again.num_cached_tokens == 36 and again.token_ids == first.token_ids
    assert first.token_ids != base.token_ids
    fresh = _engine(path, adapters).generate([prompt], SamplingParams(**greedy, lora="b"))[0]
    assert other.token_ids == fresh.token_ids


def test_a_reservation_finds_only_its_adapters_blocks():
    bm = BlockManager(16, 4)
    tokens = list(range(12))
    a, b, a1 = (SamplingParams(lora=name, lora_id=k).cache_key for name, k in (("a", 0), ("b", 0), ("a", 1)))
    blocks, cached = bm.reserve_cached(tokens, a)
    assert cached == 0
    from engine.sequence import Sequence
    seq = Sequence("r", tokens, SamplingParams(lora="a"))
    bm.adopt(seq, blocks, len(tokens))
    assert bm.reserve_cached(tokens) is not None and bm.reserve_cached(tokens)[1] == 0
    assert bm.reserve_cached(tokens, b)[1] == 0
    assert bm.reserve_cached(tokens, a)[1] == 2        # the last block is always received
    assert len({chain_seed(None), chain_seed(a), chain_seed(b), chain_seed(a1)}) == 4


def test_unknown_adapter_is_rejected_at_admission(tiny):
    path, adapters = tiny
    eng = _engine(path, {"a": adapters["a"]})
    rejected = eng.add_request("r1", [1, 2, 3], SamplingParams(lora="nope"))
    assert rejected is not None and "'nope' is not served here (adapters served: a)" in rejected.reason
    assert eng.add_request("r2", [1, 2, 3], SamplingParams(lora="a")) is None


@pytest.mark.parametrize("change, reason", [
    ({"use_dora": True}, "DoRA is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"r": 0}, "positive integer"),
])
def test_adapters_it_cannot_serve_are_refused_with_the_reason(tiny, tmp_path, change, reason):
    path, adapters = tiny
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    assert reason in read_adapter(str(bad))
    with pytest.raises(ValueError, match="LoRA adapter 'bad'"):
        _engine(path, {"bad": bad})


def test_tensors_that_do_not_fit_are_refused(tiny, tmp_path):
    path, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert "no adapter_config.json" in read_adapter(str(tmp_path / "missing"))
    other = tiny_model_dir(tmp_path / "wide", "qwen2", seed=1, head_dim=32)      # other widths
    wide = write_adapter(tmp_path / "wide-adapter", AutoModelForCausalLM.from_pretrained(other), ATTENTION)
    with pytest.raises(ValueError, match="do not fit the model"):
        _engine(path, {"w": wide})
    head = write_adapter(tmp_path / "head", hf, ("q_proj",))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(head / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="only those are supported"):
        _engine(path, {"h": head})


def test_an_ungated_mlp_takes_up_proj_whole_and_has_no_gate():
    """arcee's MLP (engine.model_dims.UNGATED_MLP): up_proj is the decoder's gate_up linear from
    column 0; an adapter of a gate_proj it does not have is refused."""
    dims = Dims.of_config({"model_type": "arcee", "hidden_size": 64, "intermediate_size": 128,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2})
    key = "base_model.model.model.layers.1.mlp.{}.lora_{}.weight"
    parts = plan({key.format("up_proj", "A"): (4, 64), key.format("up_proj", "B"): (128, 4)}, dims)
    assert [(p.layer, p.linear, p.start) for p in parts] == [(1, "gate_up", 0)]
    gate = plan({key.format("gate_proj", "A"): (4, 64), key.format("gate_proj", "B"): (128, 4)}, dims)
    assert "do not fit the model's [0, 64] projection" in gate


def test_quantized_linears_take_the_update_too(tiny):
    """int8 linears (int4's output is bf16 the same way): the adapter's update is added to their
    output: greedy tokens begin as the fp32 engine's do, with the adapter and without, and the
    adapter changes them."""
    path, adapters = tiny
    eng = _engine(path, {"a": adapters["a"]}, dtype="auto", quantization="int8")
    exact = _engine(path, {"a": adapters["a"]})
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=n) for n in (None, "a")]
    for p in params:
        q, f = eng.generate([PROMPTS[0]], p)[0], exact.generate([PROMPTS[0]], p)[0]
        assert q.token_ids[:2] == f.token_ids[:2]
    assert eng.generate([PROMPTS[0]], params[1])[0].token_ids != eng.generate([PROMPTS[0]], params[0])[0].token_ids
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
