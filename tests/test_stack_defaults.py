"""A default is written once: what `pdd up` and `pdd bench` pass on to the services defaults to the
services' own config dataclasses (shared/config.py)."""
from __future__ import annotations

import argparse

from shared.config import CommonConfig, GatewayConfig, ModelConfig, PrefillConfig, default_of, flag_help
from tools.bench.config import StackOptions
from tools.stack_config import StackConfig


def test_the_stack_defaults_to_what_each_service_defaults_to() -> None:
    stack = StackConfig()
    model = ModelConfig()
    gateway = GatewayConfig(common=CommonConfig())
    assert (stack.model, stack.dtype, stack.device) == (model.model, model.dtype, model.device)
    assert (stack.host, stack.port, stack.pipeline) == (gateway.host, gateway.port, gateway.default_pipeline)
    assert stack.log_level == CommonConfig().log_level
    assert stack.chunk_tokens == default_of(PrefillConfig, "chunk_tokens")
    bench = StackOptions()
    assert (bench.model, bench.dtype, bench.chunk_tokens) == (stack.model, stack.dtype, stack.chunk_tokens)


def test_the_stack_flags_default_and_explain_as_the_services_do() -> None:
    parser = argparse.ArgumentParser()
    StackConfig.add_arguments(parser)
    ns = parser.parse_args([])
    assert StackConfig.from_namespace(ns).model == ModelConfig().model
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["model"] == flag_help(ModelConfig, "model")
    assert str(GatewayConfig(common=CommonConfig()).max_running_requests) in (helps["max_running_requests"] or "")
