"""HybridEngine: load a hybrid checkpoint, prefill (whole or continued), decode, generate.

    eng = HybridEngine.from_pretrained(path, dtype=torch.float32, device="cpu")
    out = eng.prefill(token_ids, state=None)        # PrefillOutput(.logits [vocab], .state)
    logits, state = eng.decode_step(token_id, state)
    tokens = eng.generate(token_ids, max_new_tokens=32, temperature=0.0)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from common.engine.dtypes import WORKER_ENTRY_FORMAT, check_entry_format, torch_dtype
from common.engine.fingerprint import model_fingerprint
from common.engine.loader import CheckpointReader, built_on_meta, load_weights
from common.engine.models import TEXT_SUBCONFIG, UnsupportedArchitecture, model_class
from common.engine.models.base import HybridLM
from common.engine.pic import build_entry, prefill_segments
from common.engine.pic.compact import DEFAULT_ENTRY_FORMAT
from common.engine.pic.entry import SegmentEntry, entry_layout
from common.engine.pic.prefix import PrefixCache
from common.engine.sampling import top_p_filter
from common.engine.state import ModelState, PrefillOutput

__all__ = ["HybridEngine", "PrefillOutput", "pick_token"]


def _read_config(path: Path):
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    from common.engine.models import MODEL_REGISTRY

    if model_type not in MODEL_REGISTRY:
        raise UnsupportedArchitecture(
            f"unsupported architecture {model_type!r} in {path}/config.json; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    cfg = AutoConfig.from_pretrained(str(path))
    sub = TEXT_SUBCONFIG.get(model_type)
    text_cfg = getattr(cfg, sub) if sub else cfg
    return model_type, cfg, text_cfg


class HybridEngine:
    """One loaded model on one device; implements common.engine.pic.protocol.PicEngine."""

    def __init__(self, model: HybridLM, model_type: str, config, dtype: torch.dtype, device: torch.device | str,
                 tokenizer=None, fingerprint: str = ""):
        self.model = model
        self.model_type = model_type
        self.config = config  # the transformers text config the model was built from
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = tokenizer  # a transformers tokenizer, or None
        self.fingerprint = fingerprint
        self.vocab_size: int = model.vocab_size
        self.num_layers = len(model.layers)
        self.entry_layout = entry_layout(model)  # the per-layer kinds its segment entries have
        self.prefix_cache = PrefixCache()
        # storage format of the entries it builds and accepts (common.engine.pic.compact); a worker
        # sets it from its config, and an entry in another format is a mismatch (rebuilt)
        self.entry_format = DEFAULT_ENTRY_FORMAT

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        load_tokenizer: bool = True) -> "HybridEngine":
        path = Path(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"no config.json in {path}")
        model_type, cfg, text_cfg = _read_config(path)
        Model = model_class(model_type)
        with built_on_meta():  # every parameter comes from the checkpoint
            model = Model(text_cfg)
        reader = CheckpointReader(path, model_type)
        load_weights(model, reader, model.checkpoint_name_fn(reader), dtype, device, keep_fp32=model.fp32_params)
        model.eval()
        tokenizer = None
        if load_tokenizer and (path / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(model, model_type, text_cfg, dtype, device, tokenizer, model_fingerprint(path))

    @classmethod
    def for_worker(cls, path: str | Path, dtype: str, device: str, threads: int = 0,
                   entry_format: str = WORKER_ENTRY_FORMAT) -> "HybridEngine":
        """The engine a model worker (scatter, combine) serves: the checkpoint at `path` in the
        dtype named `dtype` on `device`, torch limited to `threads` (0: torch's default), no
        tokenizer (the router tokenizes)."""
        if threads:
            torch.set_num_threads(threads)
        engine = cls.from_pretrained(path, dtype=torch_dtype(dtype), device=device, load_tokenizer=False)
        engine.entry_format = check_entry_format(entry_format)
        return engine

    # -- core --------------------------------------------------------------------------------
    def new_state(self) -> ModelState:
        return ModelState.empty(self.num_layers)

    def check_tokens(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], state: ModelState | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, ModelState]:
        """Run tokens from `state` (not mutated). Returns (hidden [T, D], logits, new state)."""
        ids = self.check_tokens(token_ids)
        if not ids:
            raise ValueError("empty token sequence")
        state = self.new_state() if state is None else state
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        hidden, new_state = self.model(x, state)
        h = hidden[0] if all_logits else hidden[0, -1:]
        return hidden[0], self.model.logits(h), new_state

    def prefill(self, token_ids: Sequence[int], state: ModelState | None = None, chunk_size: int | None = None,
                return_all_logits: bool = False) -> PrefillOutput:
        """Prefill `token_ids` after `state` (None: from the start), optionally chunk after chunk."""
        ids = list(token_ids)
        if not ids:
            raise ValueError("empty token sequence")
        step = chunk_size or len(ids)
        pieces = []
        for s in range(0, len(ids), step):
            _, logits, state = self.forward(ids[s : s + step], state, all_logits=return_all_logits)
            pieces.append(logits)
        return PrefillOutput(
            logits=pieces[-1][-1],
            state=state,
            all_logits=torch.cat(pieces, 0) if return_all_logits else None,
        )

    # -- position-independent caching (common.engine.pic) -------------------------------------------
    def build_entry(self, token_ids: Sequence[int], seam: int = 8,
                    should_stop: Callable[[], bool] | None = None) -> SegmentEntry:
        """Prefill one segment alone and keep what its reuse needs (a SegmentEntry).
        should_stop: asked between layers; True stops the build (common.engine.pic.BuildCancelled).
        The entry is in this engine's `entry_format` (its tensors as its bytes will hold them)."""
        return build_entry(self, token_ids, seam, should_stop).with_format(self.entry_format)

    def check_entry(self, entry: SegmentEntry, token_ids: Sequence[int], seam: int) -> None:
        """Raise EntryMismatch unless `entry` is this model's entry of `token_ids` at seam width
        `seam` (the effective one: common.engine.modes.seam_for), stored in its `entry_format`."""
        entry.check(token_ids, seam=seam, fingerprint=self.fingerprint, dtype=self.dtype, layout=self.entry_layout,
                    entry_format=self.entry_format)

    def prefill_segments(self, segments: Sequence[Sequence[int]], query: Sequence[int],
                         entries: Sequence[SegmentEntry | None] | None = None, mode: str = "hypic", seam: int = 8,
                         order: str = "segment") -> PrefillOutput:
        """Prefill `segments` (token-id lists) then `query` in mode full | prefix | additive | hypic
        ("naive" is accepted for "additive").

        `entries`: a SegmentEntry or None per segment (None: built now, returned in
        out.extra["entries"] for caching). `order`: "segment" (segment-major) or "layer"
        (batched layer-major); both give the same numbers."""
        return prefill_segments(self, segments, query, entries, mode, seam, order)

    def decode_step(self, token_id: int, state: ModelState) -> tuple[torch.Tensor, ModelState]:
        _, logits, state = self.forward([token_id], state)
        return logits[-1], state

    def generate(self, prompt: Sequence[int] | PrefillOutput, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 eos_token_id: int | None = None, seed: int | None = None) -> list[int]:
        """Greedy (temperature 0) or sampled continuation of a token list or of a PrefillOutput."""
        out = prompt if isinstance(prompt, PrefillOutput) else self.prefill(prompt)
        logits, state = out.logits, out.state
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens: list[int] = []
        for i in range(max_new_tokens):
            tok = pick_token(logits, temperature, top_k, gen)
            tokens.append(tok)
            if tok == eos_token_id or i == max_new_tokens - 1:
                break
            logits, state = self.decode_step(tok, state)
        return tokens


def pick_token(logits: torch.Tensor, temperature: float, top_k: int = 0, gen: torch.Generator | None = None,
               top_p: float = 1.0) -> int:
    """The next token: argmax at temperature 0, else a (top-k, then top-p) sample; what
    generate() uses."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0:
        v, _ = torch.topk(logits, top_k)
        logits = logits.masked_fill(logits < v[-1], float("-inf"))
    logits = top_p_filter(logits, top_p)
    return int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen))
