"""Reading Hugging Face checkpoints (config.json + safetensors) into our modules.

Our modules name their parameters as the checkpoints do (after a per-architecture prefix), so
loading is a walk over `named_parameters()` with a clear error for anything missing or misshapen.
Modules are built on the meta device and every parameter is replaced by the checkpoint tensor.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn


# torch.nn.init's in-place initialisers (what module constructors call).
INIT_FUNCTIONS = tuple(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_"))


@contextmanager
def built_on_meta() -> Iterator[None]:
    """Build modules on the meta device with their weight initialisers as no-ops. Every parameter
    is then replaced by the checkpoint's (load_weights refuses one left unloaded), so they would
    compute nothing; but on the meta device torch runs normal_ / uniform_ through decompositions
    that import torch._dynamo, 2.5 s of CPU at each model worker's start. (torch.nn.init is
    patched for the duration, as transformers' no_init_weights does: build one model at a time.)"""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(nn.init, name, _leave_as_is)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _leave_as_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: names the architecture and the tensor."""


class CheckpointReader:
    def __init__(self, path: str | Path, arch: str):
        self.path = Path(path)
        self.arch = arch
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{arch}: no *.safetensors weights in {self.path}")
            self.files = {}
            for f in files:
                with safe_open(str(f), "pt") as fh:
                    for name in fh.keys():
                        self.files[name] = f
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self):
        return self.files.keys()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"{self.arch}: checkpoint {self.path} lacks weight {name!r}")
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), "pt")
        t = self._handles[f].get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.arch}: weight {name!r} has shape {tuple(t.shape)}, the config implies {tuple(shape)}"
            )
        return t


def set_tensor(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        module = getattr(module, p)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def load_weights(model: nn.Module, reader: CheckpointReader, name_of, dtype: torch.dtype, device,
                 keep_fp32: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `model` from the checkpoint. `name_of(param_name) -> ckpt name, a
    tuple of names (concatenated on dim 0) or None` (None: derived later, e.g. a tied lm_head).
    Parameters whose name ends with one of `keep_fp32` stay fp32 (decay constants whose exp must
    not lose precision)."""
    for pname, p in list(model.named_parameters()):
        ckpt = name_of(pname)
        if ckpt is None:
            continue
        if isinstance(ckpt, tuple):  # one parameter stored as several tensors: concatenated on dim 0
            t = torch.cat([reader.get(n) for n in ckpt], 0)
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{reader.arch}: weights {list(ckpt)} concatenate to shape {tuple(t.shape)}, "
                                      f"the config implies {tuple(p.shape)}")
        else:
            t = reader.get(ckpt, tuple(p.shape))
        target = torch.float32 if pname.endswith(keep_fp32) else dtype
        set_tensor(model, pname, t.to(device=device, dtype=target))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{reader.arch}: weights never loaded: {missing[:5]}")
