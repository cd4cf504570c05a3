"""python -m services.gateway: run the OpenAI-compatible gateway."""
from __future__ import annotations

from services.gateway.service import GatewayService
from shared.config import GatewayConfig
from shared.service_runtime import serve


def main() -> None:
    config = GatewayConfig.from_argv()
    serve("gateway", config.common, lambda: GatewayService(config))


if __name__ == "__main__":
    main()
