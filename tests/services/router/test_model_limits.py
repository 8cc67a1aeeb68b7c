"""services.router.model.model_max_len: the model's own prompt limit, the smallest of what its
config records and its tokenizer's model_max_length."""

from __future__ import annotations

from types import SimpleNamespace

from services.router.model import NO_TOKENIZER_LIMIT, ModelInfo, model_max_len
from hypic.launcher import DEFAULT_MODEL


def test_smallest_of_config_subconfig_and_tokenizer() -> None:
    assert model_max_len({}) is None
    assert model_max_len({"max_position_embeddings": 8192}) == 8192
    assert model_max_len({"max_position_embeddings": 8192,
                          "text_config": {"max_position_embeddings": 2048}}) == 2048
    assert model_max_len({"max_position_embeddings": 8192},
                         SimpleNamespace(model_max_length=1024)) == 1024
    # transformers' "no limit" value (int(1e30)) and a missing attribute say nothing
    assert model_max_len({"max_position_embeddings": 8192},
                         SimpleNamespace(model_max_length=NO_TOKENIZER_LIMIT)) == 8192
    assert model_max_len({"n_positions": 512}, SimpleNamespace()) == 512
    assert model_max_len({"max_position_embeddings": 0, "seq_length": "x"}) is None


def test_bundled_model_limit_and_a_quiet_tokenizer() -> None:
    info = ModelInfo.load(DEFAULT_MODEL)
    assert info.max_model_len == 4096
    # the router checks lengths itself: its tokenizer must not warn about long texts
    assert info.tokenizer.model_max_length >= NO_TOKENIZER_LIMIT
    assert len(info.encode_batch([" ".join(["vufar"] * 5000)])[0]) == 5000
