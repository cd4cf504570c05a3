"""Every NATS message pdd sends: small dataclasses with one encode/decode pair.

Messages travel as orjson objects with a "type" field naming the class. docs/protocol.md
mirrors this module; change both together.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import TypeVar

import orjson

from shared.errors import ProtocolError
from shared.names import HandoffMode, Pipeline, Role
from shared.sampling_params import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Heartbeat:
    role: Role
    instance_id: str
    kv_host: str
    kv_port: int
    model_id: str
    running: int
    waiting: int
    sent_at: float
    link_bytes_per_s: dict[str, float] = field(default_factory=dict)  # P: measured KV throughput per decoder
    stats: dict[str, float] = field(default_factory=dict)  # gauges: open inboxes/transfers, cache use, locks
    held: dict[str, list[str]] = field(default_factory=dict)  # decoders: gateway id -> request ids held for it
    # What the gateway plans with (stats are gauges, for metrics and people): 0 where it does not apply
    kv_budget_tokens: int = 0  # decoders: KV positions running requests may hold together (0: no limit)
    chunk_tokens: int = 0  # P: prompt tokens per prefill chunk
    kv_bytes_per_token: int = 0  # P: KV bytes one prompt token sends


@dataclass(frozen=True)
class KVTarget:
    """Where P streams one copy of a prompt's KV, and from which token on."""

    role: Role
    host: str
    port: int
    token_start: int = 0
    delay_s: float = 0.0  # test/demo knob: each chunk leaves this long after P made it (a slow link)
    held: bool = False  # P queues this path's KV but sends none until a ReleaseKV (or the request's end)


@dataclass(frozen=True)
class DecodeAssign:
    """Gateway to RLD or MD: expect this request's KV, then decode it."""

    request_id: str
    pipeline: Pipeline
    prompt_ids: list[int]
    sampling: SamplingParams
    relay_instance: str | None
    main_instance: str
    deadline_s: float
    handoff_at: int | None = None  # test knob: RLD hands off after exactly this many tokens
    trace_context: dict[str, str] = field(default_factory=dict)
    handoff_mode: HandoffMode | None = None  # None: RLD's own policy (--handoff-mode)
    owner: str = ""  # the gateway that dispatched it: the one that may call it orphaned (Heartbeat.held)
    output_offset: int = 0  # a migrated request: output tokens the client already has (the prompt ends with
    # them); the sampler draws token i as output token output_offset + i, and TokenChunk indices stay local
    backfill: bool = False  # MD: should RLD finish the request first, the gateway may ask P to send MD its KV
    # anyway (Abort.backfill_bytes_per_s), for MD's DRC; MD then waits for it rather than dropping the request

    @property
    def kv_tokens(self) -> int:
        """P sends KV for every prompt token but the last; the decoder feeds the last one itself."""
        return len(self.prompt_ids) - 1


@dataclass(frozen=True)
class DecodeAccepted:
    request_id: str
    instance_id: str
    kv_host: str
    kv_port: int
    cached_tokens: int = 0  # MD: prompt tokens its DRC holds (locked); P sends KV from here on
    backfill: bool = False  # MD: it would keep the KV of this request should RLD finish it first (its DRC)


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    targets: list[KVTarget]
    deadline_s: float
    trace_context: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: int | None = None  # N: P computes the whole prompt (no cache hit) and publishes
    # PromptLogprobs with the N likeliest tokens at each position; with no targets, P serves it alone


@dataclass(frozen=True)
class PromptLogprobs:
    """P to the request's event subject, once per computed chunk: the logprobs of prompt tokens
    start..start+len-1, each given the tokens before it (the first prompt token has none)."""

    request_id: str
    start: int
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class PrefillAccepted:
    request_id: str
    instance_id: str
    cached_tokens: int = 0  # prompt tokens P takes from its own prefix cache instead of computing


@dataclass(frozen=True)
class PrefillDone:
    """P to the request's event subject once every KV path is sent (or failed)."""

    request_id: str
    instance_id: str
    computed_tokens: int
    prefill_s: float
    kv_bytes: dict[str, int]
    kv_send_s: dict[str, float]


@dataclass(frozen=True)
class KVReady:
    """MD to RLD: MD holds the prompt KV and the KV of the first `adopted_tokens` output tokens.

    The first KVReady (adopted_tokens=0) says the prompt KV arrived; in Catch-Up, each later one
    says MD has recomputed the chunk RLD sent.
    """

    request_id: str
    adopted_tokens: int = 0


@dataclass(frozen=True)
class Handoff:
    """RLD to MD: eager token IDs start..start+len-1; `final` marks the cut (RLD has stopped).

    One-Shot sends one final Handoff with every eager token; Catch-Up sends chunks, then a final
    one. `finished` says RLD completed the request itself: MD drops it. When RLD is lost before
    the cut, the gateway sends one final One-Shot Handoff itself with every token the client has.
    """

    request_id: str
    eager_ids: list[int]
    finished: bool
    start: int = 0
    final: bool = True
    mode: HandoffMode = HandoffMode.ONE_SHOT


@dataclass(frozen=True)
class TokenChunk:
    """Decoder to gateway: output tokens start..start+len-1, produced by `tier`; with their logprobs
    (one per token) when the request asks for them."""

    request_id: str
    start: int
    token_ids: list[int]
    tier: Role
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class KVReceived:
    """Decoder to gateway, once its KV is complete and before its first token (NATS keeps the order)."""

    request_id: str
    tier: Role
    cached_tokens: int  # prompt tokens the decoder already had (MD's DRC hit)
    kv_tokens: int  # prompt tokens whose KV came over the socket
    kv_bytes: int
    kv_wait_s: float
    link_bytes_per_s: float | None = None  # the rate the KV arrived at (None: too little to tell)


@dataclass(frozen=True)
class CutComing:
    """RLD to MD: RLD's cut of this request follows in about `in_s` seconds, when the step making
    its last eager token ends. MD holds its next step for the cut (within --hold-steps), so the
    extend-decode pass need not wait behind a whole step of other requests. Both messages cross
    the same link, so `in_s` needs no shared clock."""

    request_id: str
    in_s: float


@dataclass(frozen=True)
class HandoffStats:
    """MD to gateway, once, when it takes over from RLD."""

    request_id: str
    eager_tokens: int
    kv_wait_s: float
    handoff_s: float  # from MD's first KVReady to the cut
    extend_s: float  # the final extend-decode pass, from the cut's arrival: extend_wait_s, then the step
    mode: HandoffMode = HandoffMode.ONE_SHOT
    chunks: int = 1  # handoff messages, the final one included
    extend_wait_s: float = 0.0  # of extend_s: the wait for MD's engine to start the step with the pass


@dataclass(frozen=True)
class CacheEvents:
    """MD's DRC changes (shared.radix_cache.CacheEvent as dicts), for the gateway's cache index."""

    instance_id: str
    events: list[dict]


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    tier: Role
    code: str
    message: str
    path: Role | None = None  # P: the KV path that failed (relay or main)


@dataclass(frozen=True)
class MainLost:
    """Gateway to RLD: MD is gone before the cut; finish the request alone (P-RLD, counted)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str
    # finished_on_relay: P still sends MD's KV, in the background at this pace, and MD keeps it in its
    # DRC for the session's next turn, instead of both dropping it (0: they drop it)
    backfill_bytes_per_s: float = 0.0


@dataclass(frozen=True)
class ReleaseKV:
    """Gateway to P: start sending the held KV paths of this request (RLD no longer finishes first)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class ErrorReply:
    """The reply to a request/reply call that could not be served."""

    code: str
    message: str


Message = (Heartbeat | DecodeAssign | DecodeAccepted | PrefillRequest | PromptLogprobs | PrefillAccepted | PrefillDone
           | KVReady | Handoff | CutComing | TokenChunk | KVReceived | HandoffStats | CacheEvents | RequestFailed
           | MainLost | Abort | ReleaseKV | ErrorReply)
M = TypeVar("M", bound=Message)

MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        Heartbeat, DecodeAssign, DecodeAccepted, PrefillRequest, PromptLogprobs, PrefillAccepted, PrefillDone,
        KVReady, Handoff, CutComing, TokenChunk, KVReceived, HandoffStats, CacheEvents, RequestFailed, MainLost, Abort,
        ReleaseKV, ErrorReply,
    )
}


def _enum_fields(cls: type) -> dict[str, type[enum.StrEnum]]:
    """The fields of `cls` typed with a shared.names enum (alone or `| None`), and that enum."""
    found: dict[str, type[enum.StrEnum]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        for option in typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,):
            if isinstance(option, type) and issubclass(option, enum.StrEnum):
                found[name] = option
    return found


_ENUM_FIELDS = {cls: _enum_fields(cls) for cls in (*MESSAGE_TYPES.values(), KVTarget)}


def _members(cls: type, d: dict) -> dict:
    """`d` (a `cls` as read off the wire) with each enum field's string turned into its member."""
    for name, kind in _ENUM_FIELDS[cls].items():
        value = d.get(name)
        if value is None:
            continue
        try:
            d[name] = kind(value)
        except ValueError:
            raise ProtocolError(f"{cls.__name__}.{name}: {value!r} is not a {kind.__name__} "
                                f"(one of {', '.join(kind)})") from None
    return d


def _to_plain(msg: Message) -> dict:
    d = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    for key, value in d.items():
        if isinstance(value, SamplingParams):
            d[key] = value.to_dict()
        elif isinstance(value, list) and value and isinstance(value[0], (KVTarget, TokenLogprob)):
            d[key] = [dataclasses.asdict(t) for t in value]
    d["type"] = type(msg).__name__
    return d


def encode(msg: Message) -> bytes:
    return orjson.dumps(_to_plain(msg), option=orjson.OPT_NON_STR_KEYS)  # keys may be members (PrefillDone's roles)


def decode(data: bytes) -> Message:
    """Parse one message; raises ProtocolError on anything that is not a known, well-formed one."""
    try:
        d = orjson.loads(data)
        cls = MESSAGE_TYPES[d.pop("type")]
        if "sampling" in d:
            d["sampling"] = SamplingParams.from_dict(d["sampling"])
        if "targets" in d:
            d["targets"] = [KVTarget(**_members(KVTarget, t)) for t in d["targets"]]
        if d.get("logprobs") is not None:
            d["logprobs"] = [TokenLogprob(float(t["logprob"]), tuple((int(i), float(lp)) for i, lp in t["top"]))
                             for t in d["logprobs"]]
        return cls(**_members(cls, d))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc


def decode_as(data: bytes, cls: type[M]) -> M:
    """Parse one message that must be a `cls`; raises ProtocolError on anything else."""
    msg = decode(data)
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg


def decode_reply(data: bytes, cls: type[M]) -> M | ErrorReply:
    """Parse the reply to a request: a `cls`, or the ErrorReply of a peer that could not serve it."""
    msg = decode(data)
    if not isinstance(msg, (cls, ErrorReply)):
        raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
