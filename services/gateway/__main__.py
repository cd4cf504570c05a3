"""python -m services.gateway: run the OpenAI-compatible gateway."""
from __future__ import annotations

import asyncio

from services.gateway.service import GatewayService
from shared import tracing
from shared.config import GatewayConfig
from shared.service_runtime import run_service, setup_logging


async def main() -> None:
    config = GatewayConfig.from_argv()
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-gateway", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(GatewayService(config), "gateway")


if __name__ == "__main__":
    asyncio.run(main())
