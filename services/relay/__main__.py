"""python -m services.relay: run one Relay Decode (RLD) instance."""
from __future__ import annotations

import asyncio

from shared import tracing
from shared.config import DecoderConfig
from shared.service_runtime import run_service, setup_logging
from services.relay.service import RelayService


async def main() -> None:
    config = DecoderConfig.from_argv("relay")
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-relay", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(RelayService(config), "relay")


if __name__ == "__main__":
    asyncio.run(main())
