import pytest

from tests.support.router_mesh import router_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """segcache (real) and two routers whose combines, scatters or segcache fail (router_mesh)."""
    yield from router_mesh(tmp_path_factory)
