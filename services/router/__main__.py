"""python -m services.router --model DIR [--port 0 --port-file PATH --segcache-address ADDR
                                     --scatter-addresses A,B --combine-addresses C ...]

Runs the router gRPC service until SIGTERM/SIGINT. With --port-file, once serving it writes
{"port": ..., "metrics_port": ..., "pid": ..., "fingerprint": ...} there (atomically), which is
how tests and launchers learn an ephemeral port. `--help` lists every flag and its env variable.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor

from common.mesh import service
from common.mesh.auth import ApiKeyInterceptor, read_secret
from protos.hypic.v1 import router_pb2_grpc as router_grpc
from services.router.config import ENV_PREFIX, RouterConfig
from services.router.model import ModelError, ModelInfo
from services.router.servicer import SERVICE_NAME, RouterServicer


DEFAULT_MAX_PROMPT_TOKENS = 32768  # for a model that records no length limit


class RouterService(service.Service):
    name = "router"
    grpc_service = SERVICE_NAME
    cfg: RouterConfig

    async def prepare(self) -> None:
        cfg = self.cfg
        self.executor = ThreadPoolExecutor(max_workers=cfg.tokenizer_threads, thread_name_prefix="router-tok")
        try:
            self.model = await asyncio.get_running_loop().run_in_executor(self.executor, ModelInfo.load, cfg.model)
        except (ModelError, OSError, ValueError) as e:
            self.log.error("cannot load the model", model=str(cfg.model), error=str(e))
            self.executor.shutdown(wait=False)
            raise service.StartupFailed from e
        limit = self.model.max_model_len
        if not cfg.max_prompt_tokens:  # an operator's explicit value stands (e.g. RoPE past it)
            cfg.max_prompt_tokens = limit or DEFAULT_MAX_PROMPT_TOKENS
        self.log.info("model", model_type=self.model.model_type, vocab_size=self.model.vocab_size,
                      fingerprint=self.model.fingerprint, tokenizer=self.model.tokenizer is not None,
                      max_model_len=limit, max_prompt_tokens=cfg.max_prompt_tokens)

    def interceptors(self) -> list:
        key = read_secret(self.cfg.api_key)
        return [ApiKeyInterceptor(key)] if key else []

    def register(self, server, port: int) -> None:
        self.servicer = RouterServicer(self.cfg, self.model, self.executor)
        router_grpc.add_RouterServicer_to_server(self.servicer, server)

    async def started(self) -> None:
        await self.servicer.start_background()

    def port_info(self) -> dict:
        return {"fingerprint": self.model.fingerprint}

    def serving_info(self) -> dict:
        cfg = self.cfg
        return {"segcache": cfg.segcache_address or None, "scatter": cfg.scatter_addresses,
                "combine": cfg.combine_addresses}

    async def close(self) -> None:
        await self.servicer.close()
        self.executor.shutdown(wait=True)


def main(argv: list[str] | None = None) -> int:
    return service.main(RouterService, RouterConfig, ENV_PREFIX, argv)


if __name__ == "__main__":
    sys.exit(main())
