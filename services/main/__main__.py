"""python -m services.main: run one Main Decode (MD) instance."""
from __future__ import annotations

import asyncio

from services.decoder.service import DecoderService
from services.main.service import MainRole
from shared import tracing
from shared.config import MainConfig
from shared.names import Role
from shared.service_runtime import run_service, setup_logging


async def main() -> None:
    config = MainConfig.from_argv()
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-main", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(DecoderService(config, MainRole(config.cache)), Role.MAIN)


if __name__ == "__main__":
    asyncio.run(main())
