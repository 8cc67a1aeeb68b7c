from tests.support.worker_mesh import engine, mesh, model_dir, workdir  # noqa: F401  (fixtures)
