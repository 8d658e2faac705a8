"""Fuzzing from the router's own OpenAPI document (schemathesis), against running deployments of a
tiny model, and the document itself as a client sees it.

Positive mode: requests that fit the document. Most are accepted (the document states every bound
the server enforces, `model` and the max_tokens limit included) and run through the prefill pool,
the KV transfer and the decode pool, as JSON and as server-sent events; every response conforms to
the document (status, content type, body, each SSE event). Negative mode: requests that break the
document; every one is a 4xx with OpenAI's error object (Anthropic's on /v1/messages' routes). Both
end with every KV block free. Each prints its own summary: per operation, generated / accepted (2xx)
/ rejected (4xx) / 5xx / failures. (schemathesis' strategies are driven by hypothesis directly: its
pytest plugin does not load under pytest 9.) The fuzzer streams few of its cases (2-12 in 100 across
runs, and once none), so the positive test also sends one streaming request per POST operation as a
schemathesis case of the document, checked by the same response checks: SSE conformance never
depends on the draw; and likewise a stored response's GET, input_items and DELETE (random ids are
only 404s). The second app keeps no responses (`responses.store: false`) and says so."""

import collections
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                response_schema_conformance, status_code_conformance)
from router.contract import LORA_PATHS
from router.messages_output import anthropic_path
from service_util import http, metrics, pools_all_free, tiny_app

pytestmark = pytest.mark.slow
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 30}   # per POST operation
PATH_ONLY_EXAMPLES = 12      # no body (a stored response's GET, DELETE, cancel): only its id to draw (random: 404s)
OFF_EXAMPLES = 10            # runtime LoRA updating, off in these apps: every answer the same 4xx
# /v1/messages/count_tokens takes /v1/messages' request (max_tokens optional): its validation is drawn there;
# /v1/score and /v1/rerank run /v1/embeddings' path (their bodies are small)
SHARED = {"/v1/messages/count_tokens": 10, "/v1/score": 15, "/v1/rerank": 15}
# vLLM's flags that shape the answer (or the prefix cache's sharing) and nothing else, left out of the
# bodies positive mode draws: with them the completions body (40 properties under 8 cross-field rules)
# is past what schemathesis' canonicalizer (jsonschema_rs) resolves, and it declines to draw any (any
# one rule or a few properties fewer and it draws). tests/test_vllm_fields.py, test_service.py and
# test_chat_prompt.py test them.
UNDRAWN = ("spaces_between_special_tokens", "return_token_ids", "return_tokens_as_token_ids", "cache_salt",
           "request_id", "add_special_tokens", "documents")


@pytest.fixture(scope="module")
def app(ray_serve, tiny_llama_dir):
    with tiny_app(ray_serve, tiny_llama_dir, "st", max_tokens_limit=8) as base:
        yield base


@pytest.fixture(scope="module")
def other_app(ray_serve, tiny_llama_dir):
    """The same model under two other names (the first the default) and another limit, colocated
    (one replica fewer to start), keeping no responses."""
    with tiny_app(ray_serve, tiny_llama_dir, "st2", served_model_name=["tiny-b", "tiny-alias"], max_tokens_limit=5,
                  mode="colocated", responses={"store": False}) as base:
        yield base


def fuzz(base: str, mode: GenerationMode, extra_checks=()) -> tuple[dict, list[str]]:
    """Every operation of the document (negative mode: those with a body), EXAMPLES[mode] cases each;
    returns per-operation counts and the failures."""
    doc = json.loads(http(base, "/openapi.json")[1])
    if mode == GenerationMode.POSITIVE:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            for field in UNDRAWN:
                doc["components"]["schemas"][name]["properties"].pop(field, None)
    schema = schemathesis.openapi.from_dict(doc)
    counts, failures = {}, []
    for operation in (result.ok() for result in schema.get_all_operations()):
        if mode == GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or not len(operation.body)):
            continue      # no body to break (input_items' query bounds: tests/test_responses_service.py)
        count = counts[operation.label] = collections.Counter()
        examples = (OFF_EXAMPLES if operation.path in LORA_PATHS else SHARED.get(operation.path, EXAMPLES[mode])) \
            if len(operation.body) else PATH_ONLY_EXAMPLES

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, phases=[Phase.generate])
        def run(case):
            response = case.call(base_url=base, timeout=120)
            status = response.status_code
            count["generated"] += 1
            count["2xx" if status < 300 else "4xx" if status < 500 else "5xx"] += 1
            count["streamed"] += status < 300 and "event-stream" in response.headers.get("content-type", [""])[0]
            problems = []
            try:
                case.validate_response(response, checks=CHECKS + list(extra_checks))
            except (AssertionError, BaseExceptionGroup) as exc:
                problems.append(str(exc)[:1500])
            if mode == GenerationMode.NEGATIVE and not (400 <= status < 500 and _error(case.path, response.text)):
                problems.append(f"not a 4xx in the route's error format: {status} {response.text[:300]}")
            if problems:
                count["failures"] += 1
                failures.extend(f"{case.method} {case.path} {case.body!r:.300}: {p}" for p in problems)
        run()
    return counts, failures


STREAMED = {"/v1/completions": {"model": "tiny", "prompt": "Once", "max_tokens": 4, "stream": True},
            "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
            "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "stream": True},
            "/v1/messages": {"model": "tiny", "max_tokens": 4, "stream": True,
                             "messages": [{"role": "user", "content": "Hi"}]}}


def _checked(case, base: str, label: str, wanted) -> list[str]:
    """Call `case` at `base`; its failures: what `wanted(response)` finds wrong (else None), or not conforming."""
    response = case.call(base_url=base, timeout=120)
    if (problem := wanted(response)) is not None:
        return [f"{label}: {problem}: {response.status_code} {response.text[:300]}"]
    try:
        case.validate_response(response, checks=CHECKS)
    except (AssertionError, BaseExceptionGroup) as exc:
        return [f"{label}: {str(exc)[:1500]}"]
    return []


def streamed_cases(base: str) -> list[str]:
    """One streaming request per POST operation, as a case of the document; its failures."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    streamed = lambda r: None if "event-stream" in r.headers.get("content-type", [""])[0] else "not a stream"
    return [failure for path, body in STREAMED.items() for failure in _checked(
        schema[path]["POST"].Case(body=body, media_type="application/json"), base, path, streamed)]


def stored_cases(base: str) -> list[str]:
    """A stored response's operations as cases of the document, on responses just made (cancel: a
    background one's); their failures."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    rids = {}
    for background in (False, True):
        status, text = http(base, "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 3,
                                                    "background": background})
        if status != 200:
            return [f"POST /v1/responses: {status} {text[:300]}"]
        rids[background] = json.loads(text)["id"]
    ok = lambda r: None if r.status_code == 200 else "not a 200"
    return [failure for path, method, query, rid in (
        ("/v1/responses/{response_id}", "GET", None, rids[False]),
        ("/v1/responses/{response_id}/input_items", "GET", {"limit": 1, "order": "asc"}, rids[False]),
        ("/v1/responses/{response_id}/cancel", "POST", None, rids[True]),
        ("/v1/responses/{response_id}", "DELETE", None, rids[False]))  # last: the others need the response
        for failure in _checked(schema[path][method].Case(path_parameters={"response_id": rid}, query=query),
                                base, f"{method} {path}", ok)]


def _error(path: str, text: str) -> bool:
    """Whether `text` is the error object of `path`'s API: OpenAI's, or Anthropic's."""
    try:
        answer = json.loads(text)
        error = answer["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if anthropic_path(path):
        return answer["type"] == "error" and set(error) == {"type", "message"} and bool(error["message"])
    return set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def summary(title: str, counts: dict) -> str:
    columns = ("generated", "2xx", "streamed", "4xx", "5xx", "failures")
    width = max(28, *(len(label) + 1 for label in counts))
    lines = [title, f"{'operation':{width}}" + "".join(f"{c:>11}" for c in columns)]
    total = collections.Counter()
    for label, count in counts.items():
        total.update(count)
        lines.append(f"{label:{width}}" + "".join(f"{count[c]:>11}" for c in columns))
    lines.append(f"{'total':{width}}" + "".join(f"{total[c]:>11}" for c in columns)
                 + f"   accepted {total['2xx'] / max(total['generated'], 1):.0%}")
    return "\n".join(lines)


def decoded(base: str) -> float:
    return sum(v for (name, _, _), v in metrics(base).items() if name == "pdserve_requests_decoded")


def test_positive_fuzzing_is_mostly_accepted_runs_through_the_pools_and_conforms(app, capsys):
    before = decoded(app)
    counts, failures = fuzz(app, GenerationMode.POSITIVE)
    with capsys.disabled():
        print("\n" + summary("schemathesis positive mode, " + ", ".join(c.__name__ for c in CHECKS), counts))
    assert not failures, "\n\n".join(failures[:3])
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages"):
        assert counts[label]["2xx"] >= 0.5 * counts[label]["generated"], counts[label]
        assert counts[label]["streamed"] < counts[label]["2xx"], counts[label]   # JSON; SSE below in any case
    failures = streamed_cases(app) + stored_cases(app)
    assert not failures, "\n\n".join(failures)
    assert decoded(app) > before                      # past the prefill pool, through the KV transfer
    assert pools_all_free(app, {"prefill", "decode"})


def test_negative_fuzzing_is_all_4xx_in_each_apis_error_format(app, capsys):
    counts, failures = fuzz(app, GenerationMode.NEGATIVE, extra_checks=[negative_data_rejection])
    with capsys.disabled():
        print("\n" + summary("schemathesis negative mode, every response a 4xx in its API's error format", counts))
    assert not failures, "\n\n".join(failures[:3])
    assert all(count["generated"] == count["4xx"] > 0 for count in counts.values()), counts
    assert http(app, "/health")[0] == 200
    assert pools_all_free(app, {"prefill", "decode"})


def _request_schemas(doc: dict) -> tuple[dict, dict, dict]:
    schemas = doc["components"]["schemas"]
    return tuple(schemas[name]["properties"] for name in ("CompletionRequest", "ChatCompletionRequest",
                                                          "MessagesRequest"))


@pytest.mark.parametrize("which", ["app", "other_app"])
def test_the_document_states_the_served_model_and_the_max_tokens_limit_of_each_config(which, request, ray_serve):
    # (`ray_serve` named so that conftest's ordering sees a test on the session cluster: the app is fetched
    # by name, which pytest's collection does not see, and the test would run among the Ray-free ones)
    base = request.getfixturevalue(which)
    names, limit = {"app": (["tiny"], 8), "other_app": (["tiny-b", "tiny-alias"], 5)}[which]
    status, text = http(base, "/openapi.json")
    assert status == 200
    completion, chat, message = _request_schemas(json.loads(text))
    for properties, fields in ((completion, ("max_tokens",)), (chat, ("max_tokens", "max_completion_tokens")),
                               (message, ())):
        assert properties["model"]["anyOf"] == [{"type": "string", "enum": names}, {"type": "null"}]
        for field in fields:
            assert [s["maximum"] for s in properties[field]["anyOf"] if s.get("type") == "integer"] == [limit]
    assert message["max_tokens"]["maximum"] == limit            # required there: an integer, not anyOf
    assert [m["id"] for m in json.loads(http(base, "/v1/models")[1])["data"]] == names
    # and the server holds to it: any of its names, the answer naming the one asked for (omitted: the first)
    for name in names:
        assert json.loads(http(base, f"/v1/models/{name}")[1])["id"] == name
        body = {"model": name, "prompt": "Hi", "max_tokens": limit}
        status, text = http(base, "/v1/completions", body)
        assert status == 200 and json.loads(text)["model"] == name
        assert http(base, "/v1/completions", {**body, "max_tokens": limit + 1})[0] == 400
        assert http(base, "/v1/completions", {**body, "model": name + "x"})[0] == 404
    assert json.loads(http(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[1])["model"] == names[0]


def test_a_server_that_keeps_no_responses_says_so(other_app):
    body = {"model": "tiny-b", "input": "Hi", "max_output_tokens": 2}
    status, text = http(other_app, "/v1/responses", body)
    assert status == 200 and json.loads(text)["store"] is False
    rid = json.loads(text)["id"]
    status, text = http(other_app, "/v1/responses", {**body, "previous_response_id": rid})
    assert status == 400 and "responses.store is off" in json.loads(text)["error"]["message"]
    for method in ("GET", "DELETE"):
        status, text = http(other_app, f"/v1/responses/{rid}", method=method)
        assert status == 404 and "keeps no responses" in json.loads(text)["error"]["message"]


def test_the_openai_client_round_trips_with_its_own_types(app):
    """The official client, streaming and not, and its pydantic types validating what came back."""
    import openai
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=app + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=4,
                                                           temperature=0, logprobs=True, top_logprobs=2)
    parsed = ChatCompletion.model_validate_json(chat.text)
    assert parsed.choices[0].finish_reason == "length" and len(parsed.choices[0].logprobs.content) == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        parsed.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4

    completion = client.completions.with_raw_response.create(model="tiny", prompt="Once", max_tokens=4,
                                                             temperature=0, logprobs=1)
    parsed = Completion.model_validate_json(completion.text)
    assert len(parsed.choices[0].logprobs.tokens) == parsed.usage.completion_tokens == 4
    # (with echo, the prompt's first token has null logprobs, as OpenAI's API answers, which the
    # client's own Completion type does not allow: the client reads it without validating)
    echoed = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once" + parsed.choices[0].text
    streamed = list(client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0, stream=True))
    assert all(isinstance(c, Completion) for c in streamed)
    assert "".join(c.choices[0].text for c in streamed) == parsed.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    for call in (lambda: client.completions.create(model="gpt-17", prompt="Once", max_tokens=2),
                 lambda: client.models.retrieve("gpt-17"), lambda: client.models.retrieve("org/tiny")):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert error.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Once", max_tokens=9)
    assert pools_all_free(app, {"prefill", "decode"})
