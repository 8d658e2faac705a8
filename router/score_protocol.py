"""vLLM's /v1/score and /v1/rerank (Jina's and Cohere's rerank): the request models and the
answers' (router/score_api.py serves them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from router.embeddings_protocol import MAX_INPUTS
from router.protocol_types import MODEL_FIELD, Int, NonEmptyText, Strict, Text

Texts = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(Strict):
    """Scores of text pairs: `text_1` one text and `text_2` many (each paired with it), or two lists
    of the same length (paired in order)."""
    model: str | None = Field(None, description=MODEL_FIELD)
    text_1: NonEmptyText | Texts = Field(description="The first text of each pair (a query): one, or one a pair.")
    text_2: NonEmptyText | Texts = Field(description="The second text of each pair (a document): one, or one a "
                                         f"pair; at most {MAX_INPUTS}.")
    user: Text | None = None

    def pairs(self) -> list[tuple[str, str]] | str:
        """The pairs in order, or why the two lists do not pair."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            return (f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                    "text_2")
        return list(zip(first, second))


class TextDocument(Strict):
    """A document as Cohere's and Jina's APIs also take it."""
    text: NonEmptyText


class RerankRequest(Strict):
    """The documents ordered by their score against the query, best first."""
    model: str | None = Field(None, description=MODEL_FIELD)
    query: NonEmptyText
    documents: Annotated[list[NonEmptyText | TextDocument], Field(min_length=1, max_length=MAX_INPUTS)] = Field(
        description=f"The texts to order (strings, or objects with a `text`), at most {MAX_INPUTS}.")
    top_n: Int(ge=0) = Field(0, description="Only the best this many; 0: all.")
    return_documents: bool = Field(True, description="Each result carries its document's text.")
    max_tokens_per_doc: Int(ge=1) | None = Field(None, description="Cohere's: each document cut to its first "
                                                 "this many tokens.")
    user: Text | None = None

    def texts(self) -> list[str]:
        """The documents' texts, in order."""
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreUsage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="The prompts' tokens (labels: each pair's; cosine: each distinct "
                                                "text's).")
    total_tokens: int = Field(ge=0)


class ScoreData(BaseModel):
    index: int = Field(ge=0, description="The pair's place in the request.")
    object: Literal["score"] = "score"
    score: float = Field(description="A label's share, in [0, 1], or a cosine similarity, in [-1, 1] "
                                     "(the server's score.method).")


class ScoreList(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(ge=0, description="The document's place in the request.")
    relevance_score: float = Field(description="As ScoreData's score.")
    document: RerankDocument | None = Field(None, description="With return_documents.")


class RerankList(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: ScoreUsage
