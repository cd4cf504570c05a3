"""python -m services.main: run one Main Decode (MD) instance."""
from __future__ import annotations

import asyncio

from shared import tracing
from shared.config import DecoderConfig
from shared.service_runtime import run_service, setup_logging
from services.main.service import MainService


async def main() -> None:
    config = DecoderConfig.from_argv("main")
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-main", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(MainService(config), "main")


if __name__ == "__main__":
    asyncio.run(main())
