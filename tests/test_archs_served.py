"""Architectures beyond Llama through the whole disaggregated path: router -> prefill replica ->
KV over gloo -> decode replica.

A tiny random Qwen3 with a head size (64) unlike hidden / heads (16), as Qwen3's real checkpoints
have (head_dim 128 beside hidden 1024 / 16 heads): the KV pool, its transfer and the decode side all
take the head size from the config. Its per-head q/k norm weights are random around 3, which makes
its attention sharp enough that the greedy tokens depend on it (with all norm weights 1 instead,
all 24 tokens of the two prompts change; around 1 they do not): K/V that arrived wrong would show.
Its every layer attends a sliding window of 16 tokens (`use_sliding_window` from layer 0), shorter
than the second prompt: the decode replica gives back the blocks the window passed as the K/V lands
and as it decodes (engine/block_manager.py), and the tokens after stay Hugging Face's.
And a tiny Gemma 3 (head size 256, as its real checkpoints; a first layer with a sliding window of 8
tokens, shorter than the second prompt, and its own RoPE), q/k norms likewise sharpened.
Greedy HTTP output, streamed and not, is Hugging Face `generate`'s, with its log-probabilities, and
every block is free after.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service_util import http, pools_all_free, sse_events, tiny_app
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(40, 81))]


@pytest.fixture(scope="module", params=[("qwen3", 64), ("gemma3_text", 256)], ids=["qwen3", "gemma3_text"])
def model_dir(request, tmp_path_factory):
    arch, head_dim = request.param
    path = tiny_model_dir(tmp_path_factory.mktemp(arch), arch, seed=4, head_dim=head_dim)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(3, 1)
    model.save_pretrained(path)
    if arch == "qwen3":                # every layer windowed: the decode replica frees passed blocks
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(sliding_window=16, use_sliding_window=True, max_window_layers=0)
        cfg.pop("layer_types", None)    # recomputed from the keys above at load
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_served_disaggregated_matches_hf_generate(ray_serve, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.config.head_dim * hf.config.num_attention_heads != hf.config.hidden_size
    if hf.config.model_type == "qwen3":
        assert hf.config.layer_types == ["sliding_attention"] * 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = []                      # (text, log-probability of each greedy token) per prompt
    for p in PROMPTS:
        x = torch.tensor([p])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            logp = torch.log_softmax(hf(out).logits[0, len(p) - 1:-1].float(), dim=-1)
        new = out[0, len(p):]
        expected.append((tokenizer.decode(new, skip_special_tokens=True),
                         logp[torch.arange(len(new)), new].tolist()))
    with tiny_app(ray_serve, model_dir, hf.config.model_type[:2]) as base:
        for prompt, (text, logprobs) in zip(PROMPTS, expected):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}
            status, body_text = http(base, "/v1/completions", body)
            assert status == 200, body_text
            choice = json.loads(body_text)["choices"][0]
            assert choice["text"] == text
            # the decode side's tokens (all but the first) are computed from the K/V that came over
            # gloo: wrong K/V moves their log-probabilities even where the greedy token survives
            assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs)) < 1e-3
            status, body_text = http(base, "/v1/completions", {**body, "stream": True})
            assert status == 200, body_text
            events = sse_events(body_text)
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == text
        assert pools_all_free(base, {"prefill", "decode"})
