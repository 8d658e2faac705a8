"""`pdserve run-batch` against the session's disaggregated app: an OpenAI batch input file's chat,
completion and embedding requests come back in its order with the answers the endpoints give
directly; a request the server refuses has its error answer; lines that are no request, and a
server that does not answer, have an error instead; the exit status says whether every line got
a 2xx answer."""

import json

import pytest

from pdserve import cli
from service_util import free_port, http, pools_all_free

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
EMBEDDING = {"model": MODEL, "input": ["a red apple", "a green pear"], "encoding_format": "float"}


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run_batch(tmp_path, lines: list[str], url: str, *flags) -> tuple[int, list[dict]]:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code = cli.main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                     "--url", url, *flags])
    return code, [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_a_batch_file_gets_each_endpoints_answers_in_its_order(disagg, tmp_path):
    good = [line("chat", "/v1/chat/completions", CHAT), line("cmpl", "/v1/completions", COMPLETION),
            line("embd", "/v1/embeddings", EMBEDDING), line("chat2", "/v1/chat/completions", {**CHAT, "n": 2})]
    code, out = run_batch(tmp_path, good * 3, disagg, "--concurrency", "4")
    assert code == 0 and [r["custom_id"] for r in out] == ["chat", "cmpl", "embd", "chat2"] * 3
    assert len({r["id"] for r in out}) == 12 and all(r["error"] is None for r in out)
    direct = {name: json.loads(http(disagg, url, body)[1]) for name, url, body in (
        ("chat", "/v1/chat/completions", CHAT), ("cmpl", "/v1/completions", COMPLETION),
        ("embd", "/v1/embeddings", EMBEDDING))}
    for r in out:
        response = r["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        if r["custom_id"] == "chat":
            assert body["choices"][0]["message"]["content"] == direct["chat"]["choices"][0]["message"]["content"]
        elif r["custom_id"] == "cmpl":
            assert body["choices"][0]["text"] == direct["cmpl"]["choices"][0]["text"]
        elif r["custom_id"] == "embd":
            for got, want in zip(body["data"], direct["embd"]["data"], strict=True):
                assert got["embedding"] == pytest.approx(want["embedding"], abs=1e-5)
        else:
            assert len(body["choices"]) == 2
    assert pools_all_free(disagg, {"prefill", "decode"})


def test_lines_that_are_no_request_and_refused_requests_are_reported_line_by_line(disagg, tmp_path):
    lines = [line("ok", "/v1/completions", COMPLETION), "{not json", json.dumps({"method": "POST"}),
             line("get", "/v1/completions", COMPLETION, method="GET"), line("where", "/v1/images", {}),
             line("stream", "/v1/completions", {**COMPLETION, "stream": True}),
             line("refused", "/v1/completions", {**COMPLETION, "temperature": "hot"}),
             line("unknown model", "/v1/embeddings", {**EMBEDDING, "model": "other"})]
    code, out = run_batch(tmp_path, lines, disagg)
    assert code == 1 and len(out) == len(lines)
    assert [r["custom_id"] for r in out] == ["ok", None, None, "get", "where", "stream", "refused", "unknown model"]
    assert out[0]["response"]["status_code"] == 200
    for r, says in zip(out[1:6], ("not JSON", "custom_id", "method must be POST", "url must be one of", "stream")):
        assert r["response"] is None and says in r["error"]["message"], r
    for r, status in zip(out[6:], (400, 404)):
        assert r["error"] is None and r["response"]["status_code"] == status
        assert set(r["response"]["body"]["error"]) == {"message", "type", "param", "code"}


def test_a_server_that_does_not_answer_leaves_each_line_an_error(tmp_path):
    code, out = run_batch(tmp_path, [line("a", "/v1/completions", COMPLETION)], f"http://127.0.0.1:{free_port()}")
    assert code == 1 and out[0]["response"] is None and out[0]["error"]["code"] == "request_failed"
    assert cli.main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x")]) == 2
