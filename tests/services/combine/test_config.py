"""The combine worker's config: --compose-order and HYPIC_COMBINE_COMPOSE_ORDER, and a worker
that refuses a bad value before loading any model."""

from __future__ import annotations

import pytest

from common.mesh.config import ConfigError, load_config
from services.combine.__main__ import main
from services.combine.config import ENV_PREFIX, CombineConfig


def test_compose_order_config(monkeypatch, capsys):
    model = ["--model", "some-model-dir"]

    def load(argv=(), **env) -> CombineConfig:
        return load_config(CombineConfig, [*model, *argv], env=env, env_prefix=ENV_PREFIX)

    assert load().compose_order == "auto"
    assert load(HYPIC_COMBINE_COMPOSE_ORDER="segment").compose_order == "segment"
    assert load(["--compose-order", "auto"], HYPIC_COMBINE_COMPOSE_ORDER="segment").compose_order == "auto"
    with pytest.raises(ConfigError, match=r"HYPIC_COMBINE_COMPOSE_ORDER.*\('auto', 'segment'\), not 'layer'"):
        load(HYPIC_COMBINE_COMPOSE_ORDER="layer")
    # the worker refuses to start (before loading any model) and says why
    monkeypatch.setenv("HYPIC_COMBINE_COMPOSE_ORDER", "Segment")
    assert main(model) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "compose_order" in err and "'Segment'" in err
