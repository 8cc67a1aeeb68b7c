"""The front's TLS settings: --https needs its certificate, the routers' CA defaults to --tls-ca,
and a certificate that cannot be read stops the front at start with one log line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.mesh.config import ConfigError, load_config
from hypic.processes import REPO_ROOT
from services.front.config import ENV_PREFIX, FrontConfig


def test_front_https_needs_its_certificate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(FrontConfig, ["--https"], env_prefix=ENV_PREFIX, env={})
    cfg = load_config(FrontConfig, ["--https", "--tls-cert", "c.pem", "--tls-key", "k.pem",
                                    "--tls-ca", "ca.pem"], env_prefix=ENV_PREFIX, env={})
    assert cfg.mutual_tls and cfg.routers_ca == Path("ca.pem")
    cfg = load_config(FrontConfig, ["--router-tls-ca", "r.pem"], env_prefix=ENV_PREFIX, env={})
    assert not cfg.https and cfg.routers_ca == Path("r.pem")


@pytest.mark.processes
def test_front_with_a_missing_certificate_stops_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    out = subprocess.run(
        [sys.executable, "-m", "services.front", "--model", str(tmp_path), "--port", "0", "--https",
         "--tls-cert", str(missing), "--tls-key", str(missing), "--no-log-json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (out.stdout + out.stderr).count("cannot load credentials") == 1
