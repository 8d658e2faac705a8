"""Incremental, UTF-8-safe detokenization and stop-string handling for streaming.

Text is emitted only when the decoded tail no longer ends in a replacement character (a
multi-byte character split across tokens) and never includes a possible beginning of a stop
string; when a stop string appears, the text is cut before it (after it with `include_stop`,
which then holds nothing back). At the end the held-back tail is
flushed, a character the last tokens left unfinished included (as the tokenizer's `decode` of the
whole output shows it: a replacement character).
"""

from __future__ import annotations

from typing import Callable


def fast_decoder(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode where the transformers tokenizer adds nothing to it (a
    `TokenizersBackend` overriding neither `decode` nor `_decode`; some models' tokenizers do):
    then it returns what `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
    clean_up_tokenization_spaces=False)` does, without the Python layers around it (1.1 against
    2.9 us a call for the default model's tokenizer here; `add` decodes twice a token). None
    otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode):
        return None
    backend = tokenizer.backend_tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = fast_decoder(tokenizer, skip_special_tokens)
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self.text = ""            # decoded output text so far (before stop truncation)
        self.emitted = 0          # characters of `text` already returned
        self.stopped = False
        self.stop_string: str | None = None    # the stop string that ended the text
        self.check_stop = True    # the engine turns this off until `min_tokens` are out

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        """Add one generated token; sets `stopped` if a stop string has now appeared. After
        that the text is final and further tokens are ignored."""
        if self.stopped:
            return
        self.ids.append(token_id)
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        """Move the decoded text over the tokens since `read_offset` unless they end inside a
        character (unless `final`); cut it at a stop string."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            old_len = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # a stop string that ends in the new text (one the text held before min_tokens does not count)
            found = [(c, len(s), s) for s in self.stop
                     if (c := self.text.find(s, max(old_len - len(s) + 1, 0))) != -1]
            if found and self.check_stop:
                at, length, self.stop_string = min(found)   # the earliest (the shorter where two start there)
                self.text = self.text[:at + length if self.include_stop else at]
                self.stopped = True

    def take(self, final: bool) -> str:
        """New text safe to show; `final` flushes the held-back tail (and an unfinished character)."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            self._advance(final=True)
        end = len(self.text) if (final or self.stopped) else max(len(self.text) - self.holdback, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
