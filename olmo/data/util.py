"""OLMo's ``olmo.data.util`` helpers that users and the original tests import."""

from __future__ import annotations

import torch

from .memmap_dataset import document_lengths

__all__ = ["get_document_lengths"]


def get_document_lengths(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """The lengths of the documents packed into ``input_ids`` (1-D): each ends after an EOS, which it includes, and
    the end of the instance closes the last one (OLMo's name for :func:`olmo.data.memmap_dataset.document_lengths`)."""
    return document_lengths(input_ids, eos_token_id)
