"""python -m services.main: run one Main Decode (MD) instance."""
from __future__ import annotations

from services.decoder.service import DecoderService
from services.main.role import MainRole
from shared.config import MainConfig
from shared.names import Role
from shared.service_runtime import serve


def main() -> None:
    config = MainConfig.from_argv()
    serve(Role.MAIN, config.common, lambda: DecoderService(config, MainRole(config.cache)))


if __name__ == "__main__":
    main()
