"""The base of every serving configuration model: unknown keys refused, values frozen."""

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
