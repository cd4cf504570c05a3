"""python -m services.relay: run one Relay Decode (RLD) instance."""
from __future__ import annotations

from services.decoder.service import DecoderService
from services.relay.role import RelayRole
from shared.config import RelayConfig
from shared.names import Role
from shared.service_runtime import serve


def main() -> None:
    config = RelayConfig.from_argv()
    serve(Role.RELAY, config.common, lambda: DecoderService(config, RelayRole(config.handoff, config.cache)))


if __name__ == "__main__":
    main()
