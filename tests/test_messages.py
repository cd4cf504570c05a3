"""Messages carry shared.names' enums: the wire holds the plain string, decoding gives the member back,
and a string that names no member is a ProtocolError that says which field and what it may be."""
from __future__ import annotations

import orjson
import pytest

from shared import messages
from shared.errors import ProtocolError
from shared.messages import (
    DecodeAssign,
    Handoff,
    Heartbeat,
    KVTarget,
    PrefillDone,
    PrefillRequest,
    RequestFailed,
    TokenChunk,
)
from shared.names import HandoffMode, Pipeline, Role
from shared.sampling_params import SamplingParams


def assign(**fields: object) -> DecodeAssign:
    base: dict = dict(request_id="r", pipeline=Pipeline.P_RLD_MD, prompt_ids=[1, 2, 3], sampling=SamplingParams(),
                      relay_instance="rld-0", main_instance="md-0", deadline_s=30.0)
    return DecodeAssign(**{**base, **fields})


def test_an_enum_field_travels_as_its_string_and_decodes_to_its_member() -> None:
    sent = assign(handoff_mode=HandoffMode.CATCH_UP)
    wire = orjson.loads(messages.encode(sent))
    assert (wire["pipeline"], wire["handoff_mode"]) == ("p-rld-md", "catch-up")
    got = messages.decode_as(messages.encode(sent), DecodeAssign)
    assert got == sent
    assert got.pipeline is Pipeline.P_RLD_MD and got.handoff_mode is HandoffMode.CATCH_UP


@pytest.mark.parametrize("msg", [
    Heartbeat(Role.MAIN, "md-0", "127.0.0.1", 1234, "tiny", 0, 0, 1.0),
    Handoff("r", [5, 6], finished=False, mode=HandoffMode.CATCH_UP),
    TokenChunk("r", 0, [7], Role.RELAY),
    RequestFailed("r", Role.PREFILL, "kv_send_failed", "gone", path=Role.MAIN),
    RequestFailed("r", Role.RELAY, "aborted", "handed off"),
    PrefillRequest("r", [1, 2], [KVTarget(Role.RELAY, "h", 1), KVTarget(Role.MAIN, "h", 2, held=True)], 30.0),
])
def test_every_enum_field_round_trips_as_its_member(msg: messages.Message) -> None:
    got = messages.decode(messages.encode(msg))
    assert got == msg
    for name, kind in messages._ENUM_FIELDS[type(msg)].items():
        value = getattr(got, name)
        assert value is None or type(value) is kind, name
    for target in getattr(got, "targets", []):
        assert type(target.role) is Role


def test_an_optional_enum_left_out_or_null_takes_its_default() -> None:
    wire = orjson.loads(messages.encode(assign()))
    del wire["handoff_mode"]
    assert messages.decode(orjson.dumps(wire)) == assign()
    wire["handoff_mode"] = None
    assert messages.decode(orjson.dumps(wire)) == assign()


@pytest.mark.parametrize("field, value, expected", [
    ("pipeline", "p-lrd-md", "DecodeAssign.pipeline: 'p-lrd-md' is not a Pipeline"),
    ("handoff_mode", "oneshot", "DecodeAssign.handoff_mode: 'oneshot' is not a HandoffMode"),
    ("pipeline", 3, "DecodeAssign.pipeline: 3 is not a Pipeline"),
])
def test_a_string_that_names_no_member_is_a_protocol_error(field: str, value: object, expected: str) -> None:
    wire = orjson.loads(messages.encode(assign()))
    wire[field] = value
    with pytest.raises(ProtocolError, match=expected):
        messages.decode(orjson.dumps(wire))


def test_a_kv_target_with_an_unknown_role_is_a_protocol_error() -> None:
    wire = orjson.loads(messages.encode(PrefillRequest("r", [1, 2], [KVTarget(Role.MAIN, "h", 1)], 30.0)))
    wire["targets"][0]["role"] = "gateway"
    with pytest.raises(ProtocolError, match="KVTarget.role: 'gateway' is not a Role"):
        messages.decode(orjson.dumps(wire))


def test_a_dict_keyed_by_role_members_encodes_as_their_strings() -> None:
    """P keys PrefillDone's per-path figures by its decoded KVTarget.role, a member now."""
    done = PrefillDone("r", "p-0", 10, 0.5, {Role.RELAY: 100, Role.MAIN: 200}, {Role.RELAY: 0.1, Role.MAIN: 0.2})
    wire = orjson.loads(messages.encode(done))
    assert wire["kv_bytes"] == {"relay": 100, "main": 200}
    assert messages.decode(messages.encode(done)) == done


def test_what_the_gateway_plans_with_travels_typed_in_the_heartbeat() -> None:
    beat = Heartbeat(Role.PREFILL, "p-0", "", 0, "tiny", 0, 0, 1.0, stats={"open_transfers": 2},
                     chunk_tokens=256, kv_bytes_per_token=46_080)
    back = messages.decode(messages.encode(beat))
    assert back == beat and back.chunk_tokens == 256 and back.kv_bytes_per_token == 46_080
    assert back.kv_budget_tokens == 0 and "chunk_tokens" not in back.stats


def test_the_decoders_kv_budget_from_their_heartbeats_caps_a_default_max_tokens() -> None:
    from services.gateway.routing.dispatcher import fit_kv_budget
    from services.gateway.routing.registry import Instance
    from services.gateway.run.attempt import GenerationRequest
    from shared.sampling_params import SamplingParams

    def decoder(budget: int) -> Instance:
        return Instance(Heartbeat(Role.MAIN, f"md-{budget}", "127.0.0.1", 1, "tiny", 0, 0, 1.0,
                                  kv_budget_tokens=budget), last_seen=0.0)

    req = GenerationRequest("req-" + "0" * 32, list(range(100)), SamplingParams(max_tokens=1000), None, None, 0.0)
    fitted = fit_kv_budget(req, [decoder(0), decoder(300), decoder(500)])
    assert fitted.sampling.max_tokens == 201  # 100 prompt positions + 200 fed outputs: the smallest budget, 300
