"""Exception types that callers handle differently.

Each service turns these into an HTTP or NATS error in exactly one place.
"""
from __future__ import annotations


class PddError(Exception):
    """Base of every error pdd raises on purpose."""

    code = "internal_error"
    instance_id: str | None = None  # the instance that failed, where the gateway's dispatcher knows it


class BadRequest(PddError):
    """The client's request is malformed or asks for something impossible."""

    code = "invalid_request_error"


class InvalidParam(BadRequest):
    """A bad value in one named request field; OpenAI clients show the field as `param`."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class PeerGone(PddError):
    """A peer service, connection or instance is not there any more."""

    code = "peer_unavailable"


class KVUnreachable(PeerGone):
    """P could not get a KV connection to a decoder: the connect or the handshake failed or timed
    out, or the decoder's connection caps were full. It names the path, not the instance: the
    decoder may be alive and serving (its heartbeat says whether it is)."""

    code = "kv_unreachable"


class InstanceStopping(PeerGone):
    """The instance reporting it cannot go on (its engine thread died) and is stopping: it will serve
    nothing more, whatever its last heartbeat or ping answer said."""

    code = "instance_stopping"


class DeadlineExceeded(PddError):
    """A wait on a peer ran past its deadline."""

    code = "deadline_exceeded"


class IncompatiblePeer(PddError):
    """A KV peer runs another model, layout or protocol version."""

    code = "incompatible_peer"


class ProtocolError(PddError):
    """A peer sent bytes that do not follow the wire format."""

    code = "protocol_error"


class KVPreempted(PddError):
    """A decoder's KV budget could not grow an older request's KV: this one gave its KV up, and the
    gateway restarts it with the tokens it made (vLLM's recompute preemption)."""

    code = "preempted"


class RequestAborted(PddError):
    """The request was aborted (client gone, stop string, or a tier failed)."""

    code = "aborted"
