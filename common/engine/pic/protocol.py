"""What common.engine.pic needs of an engine, as a Protocol.

common.engine.hybrid_engine.HybridEngine implements it (and calls into common.engine.pic); declaring the need here
keeps the imports one way: common.engine.hybrid_engine -> common.engine.pic, never back.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from common.engine.models.base import HybridLM
from common.engine.pic.prefix import PrefixCache
from common.engine.state import ModelState, PrefillOutput


class PicEngine(Protocol):
    model: HybridLM
    dtype: torch.dtype
    device: torch.device
    fingerprint: str
    prefix_cache: PrefixCache

    def new_state(self) -> ModelState: ...

    def check_tokens(self, token_ids: Sequence[int]) -> list[int]: ...

    def forward(self, token_ids: Sequence[int], state: ModelState | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, ModelState]: ...

    def prefill(self, token_ids: Sequence[int], state: ModelState | None = None, chunk_size: int | None = None,
                return_all_logits: bool = False) -> PrefillOutput: ...
