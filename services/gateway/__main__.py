"""python -m services.gateway: run the OpenAI-compatible gateway."""
from __future__ import annotations

import os

from services.gateway.service import GatewayService
from shared.config import GatewayConfig
from shared.service_runtime import serve


def main() -> None:
    # one thread per tokenisation: the gateway's own pool parallelises across requests, and a
    # tokeniser fanning one huge prompt out over every core would starve the model services beside it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = GatewayConfig.from_argv()
    serve("gateway", config.common, lambda: GatewayService(config))


if __name__ == "__main__":
    main()
