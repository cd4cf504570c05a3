"""python -m services.relay: run one Relay Decode (RLD) instance."""
from __future__ import annotations

import asyncio

from services.decoder.service import DecoderService
from services.relay.service import RelayRole
from shared import tracing
from shared.config import RelayConfig
from shared.names import Role
from shared.service_runtime import run_service, setup_logging


async def main() -> None:
    config = RelayConfig.from_argv()
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-relay", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(DecoderService(config, RelayRole(config.handoff)), Role.RELAY)


if __name__ == "__main__":
    asyncio.run(main())
