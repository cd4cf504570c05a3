"""Several instances per role in a local stack (`--instances`, StackConfig's `instances`): the first
keeps its role's name, the others are `<role>-<i>` with an instance id, KV port and WAN route of their
own; a role's own simulated device (`--sim-devices`). No process starts here."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tools.launcher import LocalStack
from tools.stack_config import (
    MD_KV_ROUTE,
    StackConfig,
    md_kv_route,
    parse_instances,
    parse_sim_devices,
    role_of,
)


def flag_after(argv: list[str], flag: str) -> str:
    """The value the service parses: argparse keeps the last of a repeated flag."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_one_instance_per_role_is_the_default_and_keeps_the_roles_names() -> None:
    assert StackConfig().service_processes() == ["prefill", "relay", "main", "gateway"]


def test_extra_instances_are_named_after_their_role_and_map_back_to_it() -> None:
    config = StackConfig(instances={"prefill": 2, "main": 4})
    assert config.service_processes() == [
        "prefill", "prefill-2", "relay", "main", "main-2", "main-3", "main-4", "gateway"]
    assert [role_of(name) for name in ("main-3", "prefill", "nats-b", "gateway")] == [
        "main", "prefill", "nats-b", "gateway"]
    assert config.datacenter_of("main-3") == "b" and config.datacenter_of("prefill-2") == "a"
    assert [md_kv_route(i) for i in (1, 2)] == [MD_KV_ROUTE, f"{MD_KV_ROUTE}_2"]


@pytest.mark.parametrize("wrong", [{"gateway": 2}, {"main": 0}, {"nats": 1}])
def test_instances_of_a_role_that_cannot_have_them_are_refused(wrong: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        StackConfig(instances=wrong)


def test_the_instance_and_device_flags_parse_per_role() -> None:
    assert parse_instances("prefill=2, main=4") == {"prefill": 2, "main": 4}
    assert parse_sim_devices("prefill=h800,main=h20") == {"prefill": "h800", "main": "h20"}
    for bad in ("main", "main=0", "gateway=2", "main=two"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_instances(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sim_devices("prefill=a100")
    with pytest.raises(ValueError, match="engine 'sim'"):
        StackConfig(sim_devices={"prefill": "h800"})


def test_pdd_up_takes_instances_and_role_devices() -> None:
    parser = argparse.ArgumentParser()
    StackConfig.add_arguments(parser)
    config = StackConfig.from_namespace(parser.parse_args(
        ["--engine", "sim", "--instances", "prefill=2,main=3", "--sim-device", "h20", "--sim-devices", "prefill=h800"]))
    assert (config.count_of("prefill"), config.count_of("relay"), config.count_of("main")) == (2, 1, 3)
    assert (config.sim_device_of("prefill"), config.sim_device_of("main")) == ("h800", "h20")


def test_each_md_binds_its_own_port_and_is_reached_through_its_own_wan_route(tmp_path: Path) -> None:
    config = StackConfig(topology="two-dc", engine="sim", sim_device="h20", sim_devices={"prefill": "h800"},
                         instances={"prefill": 2, "main": 3}, log_dir=tmp_path, cpu_affinity={"main": (0,)})
    stack = LocalStack(config)
    stack.model_path = tmp_path
    stack.md_kv_ports = {1: 21001, 2: 21002, 3: 21003}
    stack.wan_ports = {md_kv_route(i): 22000 + i for i in (1, 2, 3)}
    argv = {name: stack._service_argv(name) for name in config.service_processes()}

    assert stack.md_kv_port == 21001 and stack.md_kv_routes == [MD_KV_ROUTE, "md_kv_2", "md_kv_3"]
    for i, name in enumerate(("main", "main-2", "main-3"), start=1):
        assert (flag_after(argv[name], "--kv-port"), flag_after(argv[name], "--advertise-port")) == (
            str(21000 + i), str(22000 + i))
        assert flag_after(argv[name], "--nats-url") == stack.nats_url_b
        assert stack._cores_of(name) == (0,), "an extra instance takes its role's cores"
    assert "--instance-id" not in argv["main"], "the first keeps the service's own id, as before"
    ids = {flag_after(argv[name], "--instance-id") for name in ("prefill-2", "main-2", "main-3")}
    assert len(ids) == 3 and all(i.startswith(("prefill-2-", "main-2-", "main-3-")) for i in ids)
    assert {flag_after(argv[name], "--sim-device") for name in ("prefill", "prefill-2")} == {"h800"}
    assert {flag_after(argv[name], "--sim-device") for name in ("relay", "main", "main-3")} == {"h20"}


def test_missing_instances_keep_the_stack_waiting() -> None:
    stack = LocalStack(StackConfig(instances={"main": 4}))
    assert stack._instances_missing({"instances": {"prefill": 1, "relay": 1, "main": 3}}) == {"main": 1}
    assert stack._instances_missing({"instances": {"prefill": 1, "relay": 1, "main": 4}}) == {}
    assert LocalStack(StackConfig())._instances_missing({"instances": {}}) == {}, "one each: /healthz's 200 is enough"
