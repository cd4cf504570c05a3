"""python -m services.prefill: run one Prefill (P) instance."""
from __future__ import annotations

import asyncio

from shared import tracing
from shared.config import PrefillConfig
from shared.service_runtime import run_service, setup_logging
from services.prefill.service import PrefillService


async def main() -> None:
    config = PrefillConfig.from_argv()
    setup_logging(config.common.log_level, config.common.instance_id)
    tracing.setup_tracing("pdd-prefill", config.common.instance_id, config.common.otlp_endpoint)
    await run_service(PrefillService(config), "prefill")


if __name__ == "__main__":
    asyncio.run(main())
