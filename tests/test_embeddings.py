"""/v1/embeddings: an input's prompt runs in the prefill pool (colocated: its pool) and its final
hidden states are pooled there (engine/pooling.py).

In the engine (default model, fp32, chunks of 64 tokens, beside a generating request that drafts by
prompt lookup): last-token, mean and first-token pooling equal Hugging Face's `AutoModel` hidden
states pooled the same way, a last-token request's cached prefix changes nothing, a last prompt
token alone in its chunk takes no draft, and every block is freed. Served (the session's
disaggregated and colocated apps): OpenAI's client gets Hugging Face's vectors, in floats and
base64, from text and token ids, shortened by `dimensions`; refusals are OpenAI-format errors; a
client that leaves cancels its inputs' calls; the pools end free. The sentence-transformers files
decide the pooling.
"""

import base64
import json
import re
import time

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Rejected
from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from router.embeddings_api import EmbeddingsApi, _answer, groups, model_pooling
from serving.config import EmbeddingOptions
from service_util import http, pools_all_free, wait_until

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["hello", "The quick brown fox jumps over the lazy dog. " * 7,
         "Paged attention keeps each sequence's keys and values in fixed-size blocks. " * 12]


@pytest.fixture(scope="module")
def hf_hidden(default_model_dir):
    """Hugging Face's final hidden states [tokens, hidden] of a prompt's token ids (fp32)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]
    return hidden


@pytest.fixture(scope="module")
def engine(default_model_dir):
    """fp32, chunks of 64 tokens, prompt lookup on (a generating request beside the embeddings drafts)."""
    return LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB",
                                  max_num_batched_tokens=64, speculative_tokens=3))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


def reference(h: torch.Tensor, kind: str = "last", dimensions: int | None = None, normalize: bool = True):
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind][:dimensions]
    return (torch.nn.functional.normalize(v, dim=0) if normalize else v).numpy()


def embed_all(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Run every request to its end; {request id: (vector or token ids, cached tokens)}."""
    for rid, (ids, params) in requests.items():
        assert engine.add_request(rid, ids, params) is None
    out = {rid: [] for rid in requests}
    while engine.has_work():
        for o in engine.step():
            if o.embedding is not None:
                out[o.request_id] = (np.frombuffer(o.embedding, "<f4"), o.num_cached_tokens)
            elif o.request_id in out:
                out[o.request_id] += o.new_token_ids
    return out


def test_each_pooling_equals_hugging_faces_hidden_states_beside_a_generating_request(engine, tokenizer, hf_hidden):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > 128             # several chunks
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    alone = embed_all(engine, {"gen": (prompts[1], greedy)})["gen"]
    for kind, dims, normalize in (("last", None, True), ("mean", None, True), ("cls", None, True),
                                  ("last", 100, False), ("mean", 64, True)):
        pooling = Pooling(kind, normalize, dims)
        embeds = {f"{kind}{i}": (ids, SamplingParams(pooling=pooling)) for i, ids in enumerate(prompts)}
        out = embed_all(engine, {**embeds, "gen": (prompts[1], greedy)})
        assert out["gen"] == alone                      # the generating request beside them is unchanged
        for i, ids in enumerate(prompts):
            vector, cached = out[f"{kind}{i}"]
            np.testing.assert_allclose(vector, reference(hf_hidden(ids), kind, dims, normalize), atol=2e-5, rtol=1e-4)
            if kind != "last":                           # every position computed
                assert cached == 0
    # a last-token request takes cached blocks (an earlier request's prompt) and gives the same vector
    again = embed_all(engine, {"again": (prompts[2], SamplingParams(pooling=Pooling()))})["again"]
    assert again[1] >= 64
    np.testing.assert_allclose(again[0], reference(hf_hidden(prompts[2])), atol=2e-5, rtol=1e-4)
    rejected = engine.add_request("long", [1] * (engine.max_model_len + 1), SamplingParams(pooling=Pooling()))
    assert isinstance(rejected, Rejected) and "maximum context length" in rejected.reason
    rejected = engine.add_request("lp", [1, 2], SamplingParams(pooling=Pooling(), logprobs=1))
    assert isinstance(rejected, Rejected) and "embedding request" in rejected.reason
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_whose_last_chunk_is_one_token_takes_no_draft(engine, hf_hidden):
    """With prompt lookup on, a sequence with one token left drafts; an embedding's last prompt token
    is not a decode step (engine/ngram.py)."""
    ids = [10, 11, 12, 13] * 16 + [10]    # 64 in the first chunk, the last alone; prompt lookup would draft 11, 12, 13
    out = embed_all(engine, {kind: (ids, SamplingParams(pooling=Pooling(kind))) for kind in ("last", "mean")})
    for kind in ("last", "mean"):
        np.testing.assert_allclose(out[kind][0], reference(hf_hidden(ids), kind), atol=2e-5, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_pooling_collects_each_position_once_across_chunks_and_recomputation():
    mean, last, cls = Pooling("mean"), Pooling("last"), Pooling("cls")
    assert mean.rows(0, 16, 40, 0) == (0, 16) and mean.rows(16, 16, 40, 16) == (0, 16)
    assert mean.rows(0, 16, 40, 32) is None            # recomputed after preemption: pooled already
    assert mean.rows(16, 24, 40, 32) == (16, 24)       # only the positions it still lacks
    assert last.rows(0, 16, 40, 0) is None and last.rows(32, 8, 40, 0) == (7, 8)
    assert cls.rows(0, 16, 40, 0) == (0, 1) and cls.rows(0, 16, 40, 1) is None and cls.rows(16, 16, 40, 0) is None
    assert Pooling("max").problem() and Pooling(dimensions=0).problem() and Pooling().problem() is None


def test_the_openai_client_gets_hugging_faces_vectors_from_both_modes(disagg, colocated, tokenizer, hf_hidden):
    import openai
    ids = [tokenizer.encode(t) for t in TEXTS]
    refs = [reference(hf_hidden(i)) for i in ids]
    for base in (disagg, colocated):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        got = client.embeddings.create(model=MODEL, input=TEXTS)      # the client asks for base64
        assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL
        for d, ref in zip(got.data, refs):
            np.testing.assert_allclose(d.embedding, ref, atol=2e-5, rtol=1e-4)
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
        floats = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float", dimensions=64)
        assert len(floats.data) == 1 and len(floats.data[0].embedding) == 64
        np.testing.assert_allclose(floats.data[0].embedding, reference(hf_hidden(ids[1]), dimensions=64),
                                   atol=2e-5, rtol=1e-4)
    status, text = http(disagg, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200, text
    vector = np.frombuffer(base64.b64decode(json.loads(text)["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, refs[0], atol=2e-5, rtol=1e-4)
    assert pools_all_free(disagg, {"prefill", "decode"}) and pools_all_free(colocated, {"colocated"})


def test_a_replica_answers_a_malformed_embed_call_with_a_400_event(disagg):
    """The replica's own boundary (serving/replica_util.py `embed_events`): bytes that are no EmbedRequest,
    one without a pooling and one without prompts are 400 error events; nothing is admitted."""
    from ray import serve

    from serving import messages
    handle = serve.get_deployment_handle("PrefillServer", "pd").options(stream=True)
    no_pooling = messages.EmbedRequest("x", ((1, 2),), messages.WireSamplingParams.of(SamplingParams()))
    no_prompts = messages.EmbedRequest("y", (), messages.WireSamplingParams.of(SamplingParams(pooling=Pooling())))
    for data in (b"garbage", messages.encode(no_pooling), messages.encode(no_prompts)):
        events = [messages.decode(e) for e in handle.embed.remote(data)]
        assert len(events) == 1 and isinstance(events[0], messages.ErrorEvent) and events[0].code == 400, events
    assert pools_all_free(disagg, {"prefill", "decode"})


def _aborted(base: str) -> float:
    match = re.search(r'^pdserve_requests_total\{outcome="aborted"\} (\S+)$', http(base, "/metrics")[1], re.M)
    return float(match.group(1)) if match else 0.0


def test_a_client_that_leaves_cancels_its_inputs_in_the_pool(disagg):
    """A client gone mid-request (its connection closed) cancels every input's call: the prefill
    replica aborts them, its blocks free long before it could have computed them (48 inputs of 1,500
    tokens: minutes of fp32 prefill on one thread), and the router counts the request aborted."""
    import http.client
    before = _aborted(disagg)
    body = {"model": MODEL, "input": [[(7 * i + j) % 40000 + 100 for j in range(1500)] for i in range(48)]}
    host, _, prefix = disagg.split("//", 1)[1].partition("/")
    conn = http.client.HTTPConnection(*host.split(":"), timeout=60)
    conn.request("POST", f"/{prefix}/v1/embeddings", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(2)                                   # the first inputs are being computed
    conn.close()
    assert wait_until(lambda: _aborted(disagg) > before, 20)
    assert pools_all_free(disagg, {"prefill", "decode"}, timeout=20)


@pytest.mark.parametrize("body, code, says", [
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": [""]}, 400, "input"),
    ({"model": MODEL, "input": "hi", "dimensions": 10_000}, 400, "dimensions"),
    ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": MODEL, "input": [[1, 2], "hi"]}, 400, "input"),
    ({"model": MODEL, "input": [10**7]}, 400, "vocabulary"),
    ({"model": MODEL, "input": "word " * 9000}, 400, "maximum context length"),
    ({"model": "other", "input": "hi"}, 404, "does not exist"),
])
def test_refused_inputs_are_openai_errors(disagg, body, code, says):
    status, text = http(disagg, "/v1/embeddings", body)
    assert status == code, text
    error = json.loads(text)["error"]
    assert says in error["message"] + str(error.get("param")), error


def test_a_long_input_cut_by_truncate_prompt_tokens_is_embedded_from_its_first_tokens(disagg, tokenizer, hf_hidden):
    ids = tokenizer.encode("word " * 9000)
    status, text = http(disagg, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 300,
                                                   "encoding_format": "float"})
    assert status == 200, text
    out = json.loads(text)
    assert out["usage"]["prompt_tokens"] == 300
    np.testing.assert_allclose(out["data"][0]["embedding"], reference(hf_hidden(ids[:300])), atol=2e-5, rtol=1e-4)


def test_inputs_go_to_the_pool_in_runs_of_consecutive_ones_bounded_in_inputs_and_tokens():
    assert groups([]) == []
    assert groups([5] * 5, max_inputs=2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert groups([3, 3, 9, 1, 1], max_tokens=6) == [range(0, 2), range(2, 3), range(3, 5)]   # 9: alone
    assert [len(g) for g in groups([9] * 100)] == [32, 32, 32, 4]
    assert sum(map(len, groups([1000] * 10))) == 10 and max(map(len, groups([1000] * 10))) == 4


def test_the_answer_is_openais_list_written_a_vector_at_a_time():
    vectors = [np.array([0.5, -1.25, 3.0e-7], "<f4").tobytes(), np.array([1, 0, 0], "<f4").tobytes()]
    floats = json.loads(_answer(vectors, "float", 'a "quoted" name', 7))
    assert floats == {"object": "list", "model": 'a "quoted" name', "usage": {"prompt_tokens": 7, "total_tokens": 7},
                      "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.25, pytest.approx(3.0e-7)]},
                               {"object": "embedding", "index": 1, "embedding": [1.0, 0.0, 0.0]}]}
    encoded = json.loads(_answer(vectors, "base64", "m", 7))["data"]
    assert [base64.b64decode(d["embedding"]) for d in encoded] == vectors


def write_st(tmp_path, modules: list[str], pooling: dict | None = None):
    entries = [{"idx": i, "name": str(i), "path": "" if m == "Transformer" else f"{i}_{m}",
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        where = tmp_path / f"{modules.index('Pooling')}_Pooling"
        where.mkdir()
        (where / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                                                       "pooling_mode_mean_tokens": False, **pooling}))
    return tmp_path


def test_the_sentence_transformers_files_say_how_a_model_pools(tmp_path):
    assert model_pooling(tmp_path) == ("last", True)              # none: a decoder's default
    assert model_pooling(write_st(tmp_path / "a", ["Transformer", "Pooling", "Normalize"],
                                  {"pooling_mode_lasttoken": True})) == ("last", True)
    assert model_pooling(write_st(tmp_path / "b", ["Transformer", "Pooling"],
                                  {"pooling_mode_mean_tokens": True})) == ("mean", False)
    assert model_pooling(write_st(tmp_path / "c", ["Transformer", "Pooling", "Normalize"],
                                  {"pooling_mode_cls_token": True})) == ("cls", True)
    assert "Dense" in model_pooling(write_st(tmp_path / "d", ["Transformer", "Pooling", "Dense"],
                                             {"pooling_mode_mean_tokens": True}))
    assert "weightedmean" in model_pooling(write_st(tmp_path / "e", ["Transformer", "Pooling"],
                                                    {"pooling_mode_weightedmean_tokens": True}))

    def served(model_dir, **options):          # what the router's endpoint pools with
        api = EmbeddingsApi(EmbeddingOptions(**options), model_dir, None, None, None, 64, 128, "m", 60.0)
        return api.kind, api.normalize, api.problem
    assert served(tmp_path / "b") == ("mean", False, None)
    assert served(tmp_path / "b", pooling="last", normalize=True) == ("last", True, None)
    assert served(tmp_path / "c", pooling="mean") == ("mean", True, None)     # Normalize still read from the files
    kind, normalize, problem = served(tmp_path / "d")
    assert "Dense" in problem and "embeddings.pooling" in problem             # auto: every request a 400 saying so
    assert served(tmp_path / "d", pooling="mean", normalize=False) == ("mean", False, None)
