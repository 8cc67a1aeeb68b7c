"""The router's config: flags and HYPIC_ROUTER_* variables, and the values it refuses."""

from __future__ import annotations

import pytest

from common.mesh.config import ConfigError, load_config
from services.router.config import RouterConfig


def test_router_config_from_flags_and_env() -> None:
    cfg = load_config(RouterConfig, ["--scatter-addresses", "a:1, b:2", "--seam", "4"],
                      env={"HYPIC_ROUTER_COMBINE_ADDRESSES": "c:3,d:4",
                           "HYPIC_ROUTER_MAX_IN_FLIGHT": "7"}, env_prefix="HYPIC_ROUTER_")
    assert cfg.scatters == ["a:1", "b:2"] and cfg.combines == ["c:3", "d:4"]
    assert cfg.seam == 4 and cfg.max_in_flight == 7
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--combine-addresses", ""], env={}, env_prefix="HYPIC_ROUTER_")
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--dtype", "int8"], env={}, env_prefix="HYPIC_ROUTER_")
