"""OpenAI's /v1/embeddings: the request model and the answer's (router/embeddings_api.py serves it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from router.openai_protocol import TokenIds, as_prompts, truncate
from router.protocol_types import MODEL_FIELD, Int, NonEmptyText, Strict, Text

MAX_INPUTS = 2048   # inputs in one request, as OpenAI's


class EmbeddingRequest(Strict):
    """Embeddings of one input or a batch (each input its own vector, in order)."""
    model: str | None = Field(None, description=MODEL_FIELD)
    input: (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]) = Field(
        description=f"A string, a list of token ids, or a batch of up to {MAX_INPUTS} of either (one kind); "
                    "each within the model's context.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the little-endian float32 bytes, base64-encoded.")
    dimensions: Int(ge=1) | None = Field(
        None, description="Only the first this many values, then scaled to length 1 where the server normalizes "
                          "(a Matryoshka model's shorter embedding); at most the model's hidden size.")
    user: Text | None = None
    add_special_tokens: bool = Field(True, description="vLLM's: a text input is tokenized with the tokenizer's "
                                     "special tokens (e.g. the end-of-text token an embedding model's tokenizer "
                                     "appends); false: as written. Token ids are taken as given either way.")
    truncate_prompt_tokens: Int(ge=1) | Literal[-1] | None = Field(
        None, description="vLLM's: keep only each input's first k tokens (as sentence-transformers cuts a long "
                          "text; `truncation_side` left keeps the last k); -1: the model's context.")
    truncation_side: Literal["left", "right"] = Field(
        "right", description="Where truncate_prompt_tokens cuts: right (the default here) keeps the first k "
                             "tokens, left the last k.")

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs: one, or a batch (a list of strings or of token lists)."""
        return as_prompts(self.input)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """An input's token ids after truncate_prompt_tokens (`ids` itself when nothing is cut)."""
        return truncate(ids, self.truncate_prompt_tokens, self.truncation_side, max_model_len)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(ge=0, description="The input's place in the request.")
    embedding: list[float] | str = Field(description="The vector, or with encoding_format base64 its "
                                         "little-endian float32 bytes base64-encoded.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
