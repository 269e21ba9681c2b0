"""Answers about the server rather than a model's output: ``/v1/models``, the health probes, and the error
body every error answer (and a stream's error frame) has."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "saker"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    precision: str | None = None  # saker: the weights and activations served, in words


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok", "alive", "ready"] = "ok"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer (and a stream's error frame): OpenAI's shape, see app/errors.py."""

    error: ErrorDetail
