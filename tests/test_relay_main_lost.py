"""RLD told that MD is lost (services/relay/role.py, `_on_main_lost`): a request RLD still
decodes is finished by RLD; one whose cut RLD has sent, whether RLD still holds it (keeping its KV
for the next turn) or not, is reported back, so the gateway moves it instead of waiting for MD's
tokens until the deadline. The cut is marked sent before its publish yields: a MainLost that comes
in during that publish is answered too (a real race, seen once in CI's WAN-reset test)."""
from __future__ import annotations

from types import SimpleNamespace

from opentelemetry import trace

from services.decoder.request import DecodeRequest
from services.relay.handoff import Decision, HandoffPlan, Step
from services.relay.role import RelayRole
from shared import messages, subjects
from shared.config import HandoffConfig
from shared.errors import RequestAborted
from shared.messages import DecodeAssign, Handoff, MainLost, RequestFailed
from shared.names import HandoffMode
from shared.sampling_params import SamplingParams


class StandInIO:
    """The shell's side of the role that these paths touch: the registry, publish, metrics, marks."""

    instance_id = "rld-0"
    tracer = trace.get_tracer("test")

    def __init__(self, *requests: DecodeRequest) -> None:
        self.requests = {r.request_id: r for r in requests}
        self.published: list[tuple[str, object]] = []
        self.during_publish = None  # a coroutine function run while a publish is in flight
        self.metrics = SimpleNamespace(handoffs=SimpleNamespace(labels=lambda mode: SimpleNamespace(inc=lambda: None)))

    def find(self, request_id: str) -> DecodeRequest | None:
        return self.requests.get(request_id)

    def mark(self, request: DecodeRequest, what: str, **fields: object) -> None:
        pass

    async def publish(self, subject: str, message: object) -> None:
        if self.during_publish is not None:
            during, self.during_publish = self.during_publish, None
            await during()
        self.published.append((subject, message))


def held(request_id: str) -> DecodeRequest:
    assign = DecodeAssign(request_id, "p-rld-md", [1, 2, 3], SamplingParams(max_tokens=8), "rld-0", "md-0", 30.0)
    request = DecodeRequest(assign, inbox=None, trace_context=None)
    request.seq = SimpleNamespace(output_ids=[7, 8, 9])
    return request


def main_lost(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(data=messages.encode(MainLost(request_id, "main instance md-0 stopped answering")))


def reported_back(io: StandInIO, request_id: str) -> bool:
    return any(subject == subjects.request_events(request_id) and isinstance(m, RequestFailed)
               and m.code == RequestAborted.code for subject, m in io.published)


async def test_a_request_rld_still_decodes_is_finished_by_rld():
    request = held("decoding")
    io = StandInIO(request)
    await RelayRole(HandoffConfig())._on_main_lost(io, main_lost("decoding"))
    assert request.peer_messages.get_nowait() == MainLost("decoding", "main instance md-0 stopped answering")
    assert io.published == []


async def test_a_request_rld_handed_off_is_reported_back_held_or_not():
    request = held("keeping")  # its cut went out; RLD still keeps its KV for the next turn
    request.cut_sent = True
    io = StandInIO(request)
    role = RelayRole(HandoffConfig())
    await role._on_main_lost(io, main_lost("keeping"))
    await role._on_main_lost(io, main_lost("gone"))
    assert reported_back(io, "keeping") and reported_back(io, "gone")
    assert request.peer_messages.empty() and role.finished_without_main == 0


async def test_a_main_lost_that_arrives_while_the_cut_is_published_is_reported_back():
    request = held("racing")
    io = StandInIO(request)
    role = RelayRole(HandoffConfig())
    io.during_publish = lambda: role._on_main_lost(io, main_lost("racing"))
    plan = HandoffPlan(HandoffMode.ONE_SHOT, 4, None)
    await role._hand_off(request, io, Decision(Step.CUT, 0, 3), plan)
    assert reported_back(io, "racing") and request.peer_messages.empty()
    assert io.published[-1] == (subjects.handoff("md-0"), Handoff("racing", [7, 8, 9], finished=False, start=0,
                                                                 final=True, mode=HandoffMode.ONE_SHOT.value))
