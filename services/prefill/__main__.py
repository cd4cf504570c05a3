"""python -m services.prefill: run one Prefill (P) instance."""
from __future__ import annotations

from services.prefill.service import PrefillService
from shared.config import PrefillConfig
from shared.names import Role
from shared.service_runtime import serve


def main() -> None:
    config = PrefillConfig.from_argv()
    serve(Role.PREFILL, config.common, lambda: PrefillService(config))


if __name__ == "__main__":
    main()
