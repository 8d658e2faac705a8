"""OpenAI's `logprobs` objects from the engine's TokenLogprobs (router side, torch-free).

One `LogprobsFormatter` per choice: `chat(entries)` builds the chat API's
`{"content": [{token, logprob, bytes, top_logprobs}]}` and `completion(entries)` the legacy
completions API's `{tokens, token_logprobs, top_logprobs, text_offset}` (with `echo`, the prompt's
tokens first); a streamed choice calls it once per chunk and `text_offset` runs on across chunks.
`vllm_prompt_logprobs` builds vLLM's `prompt_logprobs` list. A token's string is the tokenizer's
decoding of it alone (special tokens included); its `bytes` are the token's exact bytes when the
tokenizer is byte-level (GPT-2 style), so a character split across tokens keeps its bytes, and
the UTF-8 encoding of that string otherwise. With vLLM's `return_tokens_as_token_ids` a token shows
as `token_id:{id}` instead (its bytes that string's), so a token no string can stand for alone (a
piece of a multi-byte character) is still identified.
"""

from __future__ import annotations

from engine.outputs import TokenLogprobs


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE uses for each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


class TokenStrings:
    """Token id -> (text, bytes), cached; shared by all requests of a router."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and raw and all(c in _BYTE_OF for c in raw) and "\ufffd" in text:
                data = [_BYTE_OF[c] for c in raw]     # part of a multi-byte character
            else:
                data = list(text.encode("utf-8"))
            hit = self._cache[token_id] = (text, data)
        return hit


class LogprobsFormatter:
    """`top`: the alternatives a token shows at most (the request's `logprobs`: an echoed prompt's
    entries may carry more, computed for vLLM's `prompt_logprobs`); None: all it carries. `as_ids`:
    tokens shown as `token_id:{id}` (vLLM's `return_tokens_as_token_ids`; text offsets still count
    the text)."""

    def __init__(self, strings: TokenStrings, top: int | None = None, as_ids: bool = False):
        self.strings, self.top, self.as_ids = strings, top, as_ids
        self.offset = 0   # characters of completion text before the next token

    def _shown(self, token_id: int) -> tuple[str, list[int]]:
        """A token as it is shown: (string, bytes)."""
        if self.as_ids:
            shown = f"token_id:{token_id}"
            return shown, list(shown.encode())
        return self.strings(token_id)

    def chat(self, entries: tuple[TokenLogprobs, ...]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text, data = self._shown(token_id)
            return {"token": text, "logprob": logprob, "bytes": data}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, entries: tuple[TokenLogprobs, ...],
                   prompt: tuple[list[int], tuple[TokenLogprobs, ...]] | None = None) -> dict:
        """`prompt` (echo): the prompt's token ids and the logprobs of its tokens after the first
        (the first token has none: null in token_logprobs and top_logprobs, as OpenAI's)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:
            ids, prompt_entries = prompt
            by_token = [None, *prompt_entries] + [None] * (len(ids) - 1 - len(prompt_entries))
            for token_id, entry in zip(ids, by_token):
                self._add(out, token_id, entry)
        for e in entries:
            self._add(out, e.token_id, e)
        return out

    def _add(self, out: dict, token_id: int, entry: TokenLogprobs | None) -> None:
        shown = self._shown(token_id)[0]
        out["tokens"].append(shown)
        out["text_offset"].append(self.offset)
        self.offset += len(self.strings(token_id)[0])
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            return
        top = {self._shown(t)[0]: v for t, v in entry.top[:self.top]}
        top.setdefault(shown, entry.logprob)   # as vLLM: the chosen token is always listed
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(top)


def vllm_prompt_logprobs(strings: TokenStrings, entries: tuple[TokenLogprobs, ...], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the prompt's first token, then for each later token (the
    engine's `entries`, in order) token id (a string) to {logprob, rank, decoded_token}: the prompt
    token first, then the k likeliest (rank 1..k) that are not it."""
    out: list[dict | None] = [None]
    for e in entries:
        item = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": strings(e.token_id)[0]}}
        for rank, (t, v) in enumerate(e.top[:k], 1):
            item.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": strings(t)[0]})
        out.append(item)
    return out
