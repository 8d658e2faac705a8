"""/v1/score and /v1/rerank: a pair's prompt (the first text's tokens, then the second's) runs in
the prefill pool, where the LM head gives the label tokens' log-probabilities at its last token
(engine/pooling.py's labels); the score is the last label's share of them (router/score_api.py).

In the engine (a tiny random llama, fp32, chunks of 16 tokens): the labels' log-probabilities equal
Hugging Face's `log_softmax` of the last logits, also for a prompt whose prefix is cached, and
every block is freed; bad labels are refused. Served (the session's disaggregated app scoring by
labels and its colocated app by cosine similarity, the default model): the scores are those of
Hugging Face's model for the same prompts (its logits, or its last hidden states), the rerank's
order is theirs best first, `top_n`, `return_documents`, document objects and `max_tokens_per_doc`
shape it, the aliases answer the same, refusals are OpenAI-format errors, and the pools end free.
"""

import asyncio
import json
import math

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import Rejected
from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from router.score_api import label_ids, score_of
from router.score_protocol import ScoreRequest
from serving import messages
from service_util import http, pools_all_free

MODEL = "SmolLM2-135M-Instruct"
QUERY = "Is the following text about animals? Answer yes or no.\n"
DOCS = ["The llama is a domesticated South American camelid.\nAnswer:",
        "Paged attention keeps keys and values in fixed-size blocks.\nAnswer:",
        "Cats and dogs are the most common pets.\nAnswer:"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    """Hugging Face's default model (fp32)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_label_logprobs(model, prompts: list[list[int]], labels: tuple[int, ...]) -> list[list[float]]:
    """Hugging Face's log-probabilities of `labels` after each prompt (`model`: a causal LM, or its
    directory, loaded in fp32)."""
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)[list(labels)].tolist() for ids in prompts]


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    status, text = http(base, path, body)
    return status, json.loads(text)


def test_scores_and_labels():
    assert score_of([math.log(0.2), math.log(0.6)]) == pytest.approx(0.75)
    assert score_of([math.log(0.3)]) == pytest.approx(0.3)
    assert score_of([-1000.0, -1.0]) == pytest.approx(1.0) and score_of([-1.0, -1000.0]) == pytest.approx(0.0)
    assert score_of([-2.0, -2.0, -2.0]) == pytest.approx(1 / 3)


def test_label_tokens_are_tokens_of_the_vocabulary(tokenizer):
    no, yes = label_ids(tokenizer, ["no", "yes"])
    assert tokenizer.convert_ids_to_tokens([no, yes]) == ["no", "yes"]
    assert label_ids(tokenizer, ["Ġyes"]) != (yes,) and isinstance(label_ids(tokenizer, ["Ġyes"]), tuple)
    problem = label_ids(tokenizer, ["no", "yes please"])
    assert isinstance(problem, str) and "'yes please' is not a token" in problem
    assert label_ids(tokenizer, [tokenizer.unk_token]) == (tokenizer.unk_token_id,)


def test_a_method_that_cannot_serve_is_a_400_and_the_model_is_checked_first(default_model_dir, tokenizer, tmp_path):
    """ScoreApi's own step 1 (nothing reaches a pool)."""
    from transformers import AutoConfig

    from engine.model_dims import Dims
    from router.embeddings_api import EmbeddingsApi
    from router.request_checks import RequestChecks
    from router.runtime_lora import RuntimeLoras
    from router.score_api import ScoreApi
    from router.score_protocol import RerankRequest
    from serving.config import AppConfig, EmbeddingOptions, ScoreOptions
    config = AppConfig(model=str(default_model_dir), served_model_name="m",
                       score={"label_tokens": ["no", "yes please"]})
    loras = RuntimeLoras(Dims.of_config(AutoConfig.from_pretrained(default_model_dir)), ())
    api = ScoreApi(config.score, RequestChecks(config, tokenizer, 8192, None, loras), None, default_model_dir, 8192,
                   "m")
    assert api.method == "labels"         # auto, for a model without sentence-transformers files
    answer = asyncio.run(api.score(ScoreRequest(text_1="a", text_2="b")))
    assert answer.status_code == 400 and json.loads(answer.body)["error"]["message"] == (
        "score.label_tokens: 'yes please' is not a token of this model's vocabulary; set the server's "
        "score.label_tokens")
    assert asyncio.run(api.score(ScoreRequest(model="x", text_1=["a", "b"], text_2="c"))).status_code == 404
    # a model with sentence-transformers files scores by cosine (auto), with the pooling they say, which
    # here is one pdserve does not run: /v1/embeddings' 400
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"},
                                                       {"type": "sentence_transformers.models.Dense"}]))
    embeddings = EmbeddingsApi(EmbeddingOptions(), tmp_path, api.checks, None, None, 576, 8192, "m", 600.0)
    cosine = ScoreApi(ScoreOptions(), api.checks, embeddings, tmp_path, 8192, "m")
    answer = asyncio.run(cosine.rerank(RerankRequest(query="a", documents=["b"])))
    assert cosine.method == "cosine" and answer.status_code == 400
    assert "modules include Dense" in json.loads(answer.body)["error"]["message"]


def test_pairs_are_one_to_many_or_in_order():
    assert ScoreRequest(text_1="q", text_2=["a", "b"]).pairs() == [("q", "a"), ("q", "b")]
    assert ScoreRequest(text_1=["q"], text_2="a").pairs() == [("q", "a")]
    assert ScoreRequest(text_1=["q", "r"], text_2=["a", "b"]).pairs() == [("q", "a"), ("r", "b")]
    assert "text_1 has 2 texts and text_2 3" in ScoreRequest(text_1=["q", "r"], text_2=["a", "b", "c"]).pairs()


def test_labels_are_refused_where_they_cannot_be_scored():
    assert Pooling("last", False, None, (1, 2)).problem() is None
    for bad in (Pooling("mean", False, None, (1,)), Pooling("last", True, None, (1,)),
                Pooling("last", False, 8, (1,)), Pooling("last", False, None, (-1,)),
                Pooling("last", False, None, tuple(range(17)))):
        assert bad.problem(), bad
    wire = messages.WireSamplingParams.of(SamplingParams(max_tokens=1, pooling=Pooling("last", False, None, (4, 9))))
    back = messages.decode(messages.encode(messages.EmbedRequest("r", ((1, 2),), wire)))
    assert back.params.to_params().pooling == Pooling("last", False, None, (4, 9))
    # an embedding's pooling without labels keeps the three fields replicas before the labels read
    plain = messages.WireSamplingParams.of(SamplingParams(max_tokens=1, pooling=Pooling("mean", False, 8)))
    assert plain.pooling == ("mean", False, 8) and plain.to_params().pooling == Pooling("mean", False, 8)


def test_the_engine_reads_hugging_faces_label_logprobs_at_the_last_token(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory="8MiB",
                                    max_num_batched_tokens=16))
    labels = (4607, 10407, 7)
    head = list(range(100, 140))
    prompts = {"short": [5, 6, 7], "long": head + [300, 301], "cached": head + [302]}   # "cached" shares 32 tokens
    params = SamplingParams(max_tokens=1, pooling=Pooling("last", False, None, labels))
    got = {}
    for rid in prompts:                     # one after the other: the third finds the second's blocks
        assert engine.add_request(rid, prompts[rid], params) is None
        while engine.has_work():
            for out in engine.step():
                got[out.request_id] = (np.frombuffer(out.embedding, "<f4"), out.num_cached_tokens)
    refs = hf_label_logprobs(tiny_llama_dir, list(prompts.values()), labels)
    for (rid, (vector, _)), ref in zip(got.items(), refs):
        np.testing.assert_allclose(vector, ref, atol=1e-4, err_msg=rid)
    assert got["cached"][1] == 32
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    rejected = engine.add_request("x", [1, 2], SamplingParams(max_tokens=1, pooling=Pooling(
        "last", False, None, (engine.runner.vocab_size,))))
    assert isinstance(rejected, Rejected) and "labels: token id out of range" in rejected.reason


def expected(model, tokenizer, method: str, cut: int | None = None) -> tuple[list[float], int, int]:
    """Hugging Face's scores of QUERY against each of DOCS (each cut to its first `cut` tokens) by
    `method`, the prompt tokens of a one-to-many request, and those of the same pairs N to N."""
    query = tokenizer.encode(QUERY)
    if method == "labels":
        prompts = [query + tokenizer.encode(doc, add_special_tokens=False)[:cut] for doc in DOCS]
        labels = label_ids(tokenizer, ["no", "yes"])
        scores = [score_of(lp) for lp in hf_label_logprobs(model, prompts, labels)]
        return scores, sum(map(len, prompts)), sum(map(len, prompts))
    docs = [tokenizer.encode(doc)[:cut] for doc in DOCS]       # each text its own input
    with torch.no_grad():     # the final hidden states, after the last norm
        hidden = [model.model(torch.tensor([ids])).last_hidden_state[0] for ids in [query, *docs]]
    vectors = [torch.nn.functional.normalize(h[-1], dim=0) for h in hidden]
    tokens = len(query) + sum(map(len, docs))
    return [float(vectors[0] @ v) for v in vectors[1:]], tokens, tokens


@pytest.mark.parametrize("app, method", [("disagg", "labels"), ("colocated", "cosine")])
def test_served_scores_are_hugging_faces_and_rerank_orders_by_them(app, method, disagg, colocated, tokenizer,
                                                                    hf_model):
    """The session's disaggregated app scores by the label tokens, its colocated one by cosine
    similarity (tests/conftest.py). Both apps are named as fixtures: a test that starts them runs
    with the others that need them, last (conftest's grouping reads the fixture names)."""
    base = {"disagg": disagg, "colocated": colocated}[app]
    refs, tokens, pair_tokens = expected(hf_model, tokenizer, method)
    status, body = post(base, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in body["data"]], refs, atol=1e-4)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # N to N: each pair in order
    status, pairs = post(base, "/score", {"text_1": [QUERY] * 3, "text_2": DOCS})
    assert status == 200 and pairs["usage"]["prompt_tokens"] == pair_tokens, pairs
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], refs, atol=1e-4)
    status, ranked = post(base, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS})
    assert status == 200, ranked
    order = sorted(range(3), key=lambda i: -refs[i])
    assert [r["index"] for r in ranked["results"]] == order, (ranked, refs)
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], [refs[i] for i in order], atol=1e-4)
    # Cohere's and Jina's document objects, and Cohere's max_tokens_per_doc (the first 4 tokens)
    short_refs, short_tokens, _ = expected(hf_model, tokenizer, method, cut=4)
    status, cut = post(base, "/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                            "max_tokens_per_doc": 4})
    assert status == 200 and cut["usage"]["prompt_tokens"] == short_tokens, cut
    assert [r["document"]["text"] for r in cut["results"]] == [DOCS[r["index"]] for r in cut["results"]]
    np.testing.assert_allclose(sorted(r["relevance_score"] for r in cut["results"]), sorted(short_refs), atol=1e-4)
    for alias in ("/rerank", "/v2/rerank"):
        status, top = post(base, alias, {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False})
        assert status == 200 and [r["index"] for r in top["results"]] == order[:2], top
        assert all("document" not in r for r in top["results"]) and top["usage"]["prompt_tokens"] == tokens
    pools = {"prefill", "decode"} if app == "disagg" else {"colocated"}
    assert pools_all_free(base, pools)


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1 has 2 texts and text_2 3"),
    ("/v1/score", {"model": "nope", "text_1": "a", "text_2": "b"}, 404, "model 'nope' does not exist"),
    ("/v1/score", {"text_1": "a", "text_2": []}, 400, "text_2"),
    ("/v1/rerank", {"query": "a " * 9000, "documents": ["b"]}, 400, "maximum context length is 8192 tokens; pair 0"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"query": "", "documents": ["b"]}, 400, "query"),
])
def test_refusals_are_openai_errors(disagg, path, body, status, needle):
    got, answer = post(disagg, path, body)
    assert got == status and needle in answer["error"]["message"], answer
    assert answer["error"]["type"] in ("invalid_request_error", "NotFoundError", "not_found_error") or status == 404
