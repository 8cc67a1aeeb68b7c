from tests.support.segcache_process import launch  # noqa: F401  (the fixture every segcache test starts servers with)
