"""shared/config.py: each default written once (the dataclass field), flags and PDD_* variables built from it."""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator

import pytest

from shared.config import (
    CacheConfig,
    CommonConfig,
    DecoderConfig,
    EngineConfig,
    GatewayConfig,
    HandoffConfig,
    MainConfig,
    ModelConfig,
    NatsAuth,
    PrefillConfig,
    RelayConfig,
    env_name,
    flag_default,
    flag_fields,
    flag_name,
)

CONFIG_CLASSES = (NatsAuth, CommonConfig, ModelConfig, EngineConfig, CacheConfig, HandoffConfig, PrefillConfig,
                  DecoderConfig, RelayConfig, MainConfig, GatewayConfig)
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "prefill": PrefillConfig.parser, "relay": RelayConfig.parser, "main": MainConfig.parser,
    "gateway": GatewayConfig.parser}


@pytest.fixture(autouse=True)
def no_pdd_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in [k for k in os.environ if k.startswith("PDD_")]:
        monkeypatch.delenv(key)
    yield


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings != ["-h", "--help"]}


def fields_by_flag() -> dict[str, list[dataclasses.Field]]:
    found: dict[str, list[dataclasses.Field]] = {}
    for cls in CONFIG_CLASSES:
        for f in flag_fields(cls):
            if f not in found.get(f"--{flag_name(f)}", []):
                found.setdefault(f"--{flag_name(f)}", []).append(f)
    return found


@pytest.mark.parametrize("role", PARSERS)
def test_every_flag_is_a_config_field_and_defaults_to_it(role: str) -> None:
    fields = fields_by_flag()
    for option, action in options(PARSERS[role]()).items():
        assert option in fields, f"{role}: {option} is declared outside the config dataclasses"
        defaults = {flag_default(f) for f in fields[option]}
        assert defaults == {action.default}, f"{role}: {option} defaults to {action.default}, its field to {defaults}"


@pytest.mark.parametrize("role", PARSERS)
def test_a_config_parsed_from_no_flags_holds_the_dataclass_defaults(role: str) -> None:
    config = {"prefill": PrefillConfig, "relay": RelayConfig, "main": MainConfig,
              "gateway": GatewayConfig}[role].from_argv([])
    resolved = {"instance_id", "advertise_host", "kv_wire_dtype"}  # empty means "derive": checked below
    flags = options(PARSERS[role]())

    def check(obj: object) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                check(value)
            elif f in flag_fields(type(obj)) and f"--{flag_name(f)}" in flags and f.name not in resolved:
                assert value == f.default, f"{role}: {type(obj).__name__}.{f.name} is {value}, default {f.default}"

    check(config)
    assert config.common.instance_id.startswith(f"{role}-")


def test_the_defaults_that_once_drifted_are_the_flags() -> None:
    assert EngineConfig().kv_budget_tokens == RelayConfig.from_argv([]).engine.kv_budget_tokens == 65536
    assert MainConfig.from_argv([]).engine.kv_budget_tokens == 65536
    assert PrefillConfig.from_argv([]).engine.kv_budget_tokens == 0, "P has no KV budget"
    gateway = GatewayConfig(common=CommonConfig())
    assert gateway.max_running_requests == GatewayConfig.from_argv([]).max_running_requests == 64
    assert GatewayConfig.from_argv([]).ttft_slo_s == gateway.ttft_slo_s == 2.0


def test_an_environment_variable_overrides_a_default_and_a_flag_overrides_both(monkeypatch) -> None:
    monkeypatch.setenv("PDD_KV_BUDGET_TOKENS", "1234")
    monkeypatch.setenv("PDD_HANDOFF_MODE", "catch-up")
    monkeypatch.setenv("PDD_TTFT_SLO_MS", "500")
    monkeypatch.setenv("PDD_NATS_USER", "pdd")
    monkeypatch.setenv("PDD_NATS_PASSWORD_FILE", "/secrets/p")
    relay = RelayConfig.from_argv([])
    assert (relay.engine.kv_budget_tokens, relay.handoff.mode) == (1234, "catch-up")
    assert relay.common.nats_auth == NatsAuth("pdd", "/secrets/p")
    assert RelayConfig.from_argv(["--kv-budget-tokens", "99"]).engine.kv_budget_tokens == 99
    assert GatewayConfig.from_argv([]).ttft_slo_s == 0.5
    assert GatewayConfig.from_argv(["--ttft-slo-ms", "250"]).ttft_slo_s == 0.25


def test_a_bad_environment_value_fails_at_start(monkeypatch) -> None:
    monkeypatch.setenv("PDD_KV_PORT", "ninety")
    with pytest.raises(ValueError, match="ninety"):
        MainConfig.parser()


def test_every_variable_is_named_after_its_flag() -> None:
    for option, fields in fields_by_flag().items():
        for f in fields:
            assert env_name(f) == "PDD_" + option.removeprefix("--").upper().replace("-", "_")


def test_each_role_has_its_own_flags_and_no_dummy_fields() -> None:
    relay, main, prefill, gateway = (set(options(PARSERS[r]())) for r in ("relay", "main", "prefill", "gateway"))
    assert {"--handoff-mode", "--catch-up-threshold", "--catch-up-max-running"} <= relay - main
    assert {"--kv-host", "--kv-port", "--advertise-host", "--advertise-port", "--kv-budget-tokens",
            "--cache-tokens", "--cache-bytes"} <= relay & main  # RLD keeps its own prefix cache too
    assert {"--chunk-tokens", "--kv-wire-dtype", "--cache-tokens", "--max-batch-tokens"} <= prefill
    assert "--kv-budget-tokens" not in prefill and "--metrics-port" not in gateway
    assert not RelayConfig.from_argv(["--cache-tokens", "0"]).cache.enabled and RelayConfig.from_argv([]).cache.enabled
    assert "handoff" not in {f.name for f in dataclasses.fields(MainConfig)}
    main_config = MainConfig.from_argv(["--cache-tokens", "0", "--kv-host", "0.0.0.0", "--kv-port", "9200"])
    assert not main_config.cache.enabled and main_config.kv_port == 9200 and main_config.advertise_host != "0.0.0.0"
    assert RelayConfig.from_argv(["--advertise-host", "rld.a"]).advertise_host == "rld.a"


def test_kv_wire_dtype_defaults_to_the_models() -> None:
    assert PrefillConfig.from_argv(["--dtype", "bfloat16"]).kv_wire_dtype == "bfloat16"
    assert PrefillConfig.from_argv(["--dtype", "bfloat16", "--kv-wire-dtype", "float16"]).kv_wire_dtype == "float16"


def test_choices_come_from_the_names() -> None:
    assert options(GatewayConfig.parser())["--pipeline"].choices == ("auto", "p-md", "p-rld-md")
    assert options(RelayConfig.parser())["--handoff-mode"].choices == ("auto", "one-shot", "catch-up")
    assert options(GatewayConfig.parser())["--failure-policy"].choices == ("recover", "fail")
    assert options(PrefillConfig.parser())["--kv-wire-dtype"].choices == ("", "float32", "bfloat16", "float16")
