"""vLLM's /v1/score and /v1/rerank (Jina's and Cohere's rerank API), two ways (`score.method`):
  * labels: how likely the model finds a label token ("yes" against "no" by default,
    `score.label_tokens`) as the next token after a query and a document. A causal LM run as a
    cross-encoder, as vLLM runs Qwen3-Reranker (`classifier_from_token: ["no", "yes"]`) and scores
    with any causal LM (its generative scores): the prefill pool runs each pair's prompt and reads
    the labels off the LM head at its last token (engine/pooling.py's labels);
  * cosine: the cosine similarity of the two texts' embeddings (/v1/embeddings' pooling, each text
    its own input), as vLLM scores with an embedding model; the default for a model with
    sentence-transformers files.
Either way the prefill pool alone runs the prompts: no decode replica, no KV hand-off.

Life cycle of a request (router/app.py validated the body: router/score_protocol.py)
  1. model     the served model or a LoRA adapter, else a 404; the method servable (labels: each a
               token of the vocabulary; cosine: the model's pooling one pdserve runs), else a 400
  2. pair      /score: text_1 with each text_2, or the two lists in order; /rerank: the query with
               each document (cut to `max_tokens_per_doc`). labels: a pair's prompt is the first
               text's tokens (with the tokenizer's special tokens) then the second's (without), as
               vLLM builds it; cosine: each distinct text is a prompt of its own (with them).
               Tokenized in a worker thread
  3. check     each prompt within the model's context, else an OpenAI-format 400
  4. run       the prompts as /v1/embeddings runs its inputs (EmbeddingsApi.pool: groups of prompts
               in the pool, under the request deadline, a client that leaves cancels them; a shared
               query is computed once and then found in the prefix cache); each answer is the
               labels' log-probabilities, or a text's unit vector
  5. respond   each pair's score, the last label's share of the labels' probability (one label:
               its probability) or the vectors' dot product; /rerank's best first, the first
               `top_n`, with their documents
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from pathlib import Path

from engine.pooling import Pooling
from engine.sampling_params import SamplingParams
from router.embeddings_api import EmbeddingsApi, floats
from router.openai_responses import error_response
from router.request_checks import RequestChecks
from router.score_protocol import RerankRequest, ScoreRequest
from serving.config import ScoreOptions

log = logging.getLogger(__name__)


def label_ids(tokenizer, labels: list[str]) -> tuple[int, ...] | str:
    """Each label's token id (a token of the vocabulary, as vLLM's classifier_from_token takes
    it: `convert_tokens_to_ids`, so "yes" is not " yes"), or why one is not a token."""
    ids = []
    for label in labels:
        token = tokenizer.convert_tokens_to_ids(label)
        if token is None or (token == tokenizer.unk_token_id and label != tokenizer.unk_token):
            return f"score.label_tokens: {label!r} is not a token of this model's vocabulary"
        ids.append(int(token))
    return tuple(ids)


def score_of(logprobs: list[float]) -> float:
    """The last label's share of the labels' probability (one label: its probability)."""
    if len(logprobs) == 1:
        return math.exp(logprobs[0])
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    return weights[-1] / sum(weights)


class ScoreApi:
    """`/v1/score` and `/v1/rerank` for the router (router/app.py)."""

    def __init__(self, options: ScoreOptions, checks: RequestChecks, embeddings: EmbeddingsApi,
                 model_dir: Path, max_model_len: int, model_name: str):
        self.checks, self.embeddings = checks, embeddings
        self.max_model_len, self.model_name = max_model_len, model_name
        self.method = options.method
        if self.method == "auto":
            self.method = "cosine" if (model_dir / "modules.json").is_file() else "labels"
        self.labels = label_ids(checks.tokenizer, options.label_tokens)
        if self.method == "labels" and isinstance(self.labels, str):
            log.warning("/v1/score and /v1/rerank: %s", self.labels)

    async def score(self, body: ScoreRequest):
        """Steps 1-5 of the module's docstring for /v1/score: the answer, or an OpenAI-format error."""
        scored = await self._scores(body.model, body.pairs())
        if not isinstance(scored, tuple):
            return scored
        scores, tokens = scored
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": body.model or self.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, body: RerankRequest):
        """Steps 1-5 of the module's docstring for /v1/rerank: the answer, or an OpenAI-format error."""
        documents = body.texts()
        scored = await self._scores(body.model, [(body.query, doc) for doc in documents], body.max_tokens_per_doc)
        if not isinstance(scored, tuple):
            return scored
        scores, tokens = scored
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i]} for i in order]
        if body.return_documents:
            for result in results:
                result["document"] = {"text": documents[result["index"]]}
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or self.model_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(self, model: str | None, pairs: list[tuple[str, str]] | str, second_tokens: int | None = None):
        """Steps 1-4: (each pair's score, the prompts' tokens), or the error (`pairs` a string: why
        the texts do not pair; `second_tokens`: each second text cut to its first this many tokens)."""
        if (problem := self.checks.model_problem(model)) is not None:
            return problem
        if self.method == "labels" and isinstance(self.labels, str):
            return error_response(400, f"{self.labels}; set the server's score.label_tokens")
        if self.method == "cosine" and self.embeddings.problem is not None:
            return error_response(400, self.embeddings.problem)
        if isinstance(pairs, str):
            return error_response(400, pairs, param="text_2")
        firsts = list(dict.fromkeys(first for first, _ in pairs))
        labels = self.method == "labels"
        seconds = [second for _, second in pairs] if labels else list(dict.fromkeys(s for _, s in pairs))
        heads = await self.checks.token_ids(firsts, True, "text_1")
        if not isinstance(heads, list):
            return heads
        tails = await self.checks.token_ids(seconds, not labels, "text_2")
        if not isinstance(tails, list):
            return tails
        tails = [ids[:second_tokens] for ids in tails]
        if labels:
            first_ids = dict(zip(firsts, heads))
            prompts = [first_ids[first] + ids for (first, _), ids in zip(pairs, tails)]
            pooling = Pooling("last", False, None, self.labels)
        else:
            prompts = heads + tails
            pooling = Pooling(self.embeddings.kind, True, None)
        for i, ids in enumerate(prompts):
            if len(ids) > self.max_model_len:
                what = f"pair {i}" if labels else f"text {i}"
                return error_response(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                                      f"{what} has {len(ids)} tokens")
        params = self.checks.with_lora(SamplingParams(max_tokens=1, pooling=pooling), model)
        answers = await self.embeddings.pool(f"score-{uuid.uuid4().hex}", prompts, params)
        if not isinstance(answers, list):
            return answers
        tokens = sum(map(len, prompts))
        if labels:
            return [score_of(floats(answer)) for answer in answers], tokens
        return await asyncio.to_thread(cosines, pairs, dict(zip(firsts, answers)),
                                       dict(zip(seconds, answers[len(firsts):]))), tokens


def cosines(pairs: list[tuple[str, str]], firsts: dict[str, bytes], seconds: dict[str, bytes]) -> list[float]:
    """Each pair's dot product of its texts' unit vectors (in a worker thread: 2,048 pairs of
    576 numbers are ~1.2 M products)."""
    ones, twos = {t: floats(v) for t, v in firsts.items()}, {t: floats(v) for t, v in seconds.items()}
    return [math.fsum(a * b for a, b in zip(ones[first], twos[second])) for first, second in pairs]
