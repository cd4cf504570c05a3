"""Main Decode (MD)'s role in the decoder shell: decode from the first token (P-MD) or take over from RLD.

Taking over is extend-decode: MD feeds the last prompt token and RLD's eager token IDs in one
forward pass, which rebuilds their KV, and samples the next token from its logits. Which tokens to
feed when is services/main/takeover.py's; the DRC is services/decoder/decode_cache.py's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import cast

from nats.aio.msg import Msg

from services.decoder.decode_cache import CachingRole
from services.decoder.request import DecodeRequest, PeerMessage, Phase
from services.decoder.role import DecoderIO
from services.main.takeover import Adoption, Move, Pass, Takeover
from shared import messages, subjects
from shared.config import CacheConfig
from shared.errors import PddError
from shared.kv_transfer_state import TransferState
from shared.messages import Abort, CutComing, Handoff, HandoffStats, KVReady
from shared.metrics import MainMetrics
from shared.names import AbortReason, Pipeline, Role

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """What the takeover hands to MD's decoding: the cut, the Catch-Up passes not yet done, the stats."""

    adoption: Adoption
    queued: list[asyncio.Future]
    stats: HandoffStats


async def _settled(queued: list[asyncio.Future]) -> None:
    """Wait for the queued passes (in order: the engine runs a request's work in order); empties the list."""
    futures = list(queued)
    queued.clear()
    await asyncio.gather(*futures)


def _adopt_arrived(request: DecodeRequest, takeover: Takeover, handoff: Handoff) -> Adoption:
    """Adopt `handoff` and every chunk that arrived meanwhile, in order, into the request's output;
    stops at the cut, or where RLD says it finished the request."""
    while True:
        adoption = takeover.adopt(handoff)
        if adoption.move is Move.RELAY_FINISHED:
            return adoption
        request.sequence.output_ids.extend(adoption.new_ids)
        if adoption.move is Move.CUT or request.peer_messages.empty():
            return adoption
        handoff = _handoff(request.peer_messages.get_nowait())


def _handoff(message: PeerMessage) -> Handoff:
    """MD's peer messages are RLD's handoffs: _on_handoff queues nothing else."""
    assert isinstance(message, Handoff), message
    return message


class MainRole(CachingRole):
    """MD's cache is the DRC: a finished request's KV is kept before its last token goes out."""

    role = Role.MAIN

    def __init__(self, cache: CacheConfig) -> None:
        super().__init__(cache)

    async def subscribe(self, io: DecoderIO) -> None:
        async def on_handoff(msg: Msg) -> None:
            await self._on_handoff(io, msg)

        await io.subscribe(subjects.handoff(io.instance_id), on_handoff)

    def can_backfill(self) -> bool:
        return self.cache is not None

    def keeps_after_abort(self, request: DecodeRequest, abort: Abort) -> bool:
        """RLD finished the request and P sends its KV anyway (a backfill): wait for it, keep it in
        the DRC, so the session's next turn hits here; the request then ends as RELAY_FINISHED."""
        if not (abort.reason == AbortReason.FINISHED_ON_RELAY and abort.backfill_bytes_per_s > 0
                and request.assign.backfill and self.can_backfill()):
            return False
        request.backfill = True
        request.peer_messages.put_nowait(Handoff(request.request_id, [], finished=True))  # if RLD's never came
        return True

    async def settle(self, request: DecodeRequest, io: DecoderIO) -> None:
        if request.phase is Phase.RELAY_FINISHED:  # a finished request was kept before its last token went out
            await self.keep(request, io)

    async def _on_handoff(self, io: DecoderIO, msg: Msg) -> None:
        try:
            handoff = messages.decode(msg.data)
        except PddError:
            return
        if not isinstance(handoff, Handoff | CutComing):
            return
        request = io.find(handoff.request_id)
        if request is None:  # RLD, with the whole prompt cached, may stream before MD registered the request
            io.keep_early(handoff.request_id, lambda: self._on_handoff(io, msg))
            return
        if isinstance(handoff, CutComing):
            io.mark(request, "cut_coming_received", in_s=handoff.in_s)
            request.cut_announced = True
            if request.seq is not None and request.seq.kv is not None:  # admitted: the engine can hold for it
                io.expect(request, handoff.in_s)
            return
        if (handoff.finished and request.inbox.state is not TransferState.DONE and request.task is not None
                and not (request.assign.backfill and self.can_backfill())):
            # RLD finished before our KV arrived: drop the transfer now, not at the gateway's abort
            # (with a backfill asked for, the gateway's abort says whether P sends it anyway)
            request.task.cancel()
            return
        if handoff.final:
            io.mark(request, "cut_received", eager_tokens=handoff.start + len(handoff.eager_ids))
        request.peer_messages.put_nowait(handoff)

    async def decode(self, request: DecodeRequest, io: DecoderIO) -> Phase:
        assign, seq = request.assign, request.sequence
        feed = [assign.prompt_ids[-1]]
        unfeed = 0
        queued: list[asyncio.Future] = []  # the takeover's Catch-Up passes still running or queued
        stats: HandoffStats | None = None
        if assign.pipeline == Pipeline.P_RLD_MD:
            taken = await self._take_over(request, io)
            if taken is None:
                return Phase.RELAY_FINISHED
            feed, unfeed, queued, stats = taken.adoption.feed_ids, taken.adoption.unfeed, taken.queued, taken.stats
        with io.tracer.start_as_current_span("main.decode") as span:
            first = len(seq.output_ids)
            span.set_attribute("pdd.first_index", first)
            t0 = time.monotonic()
            if stats is not None:
                with io.tracer.start_as_current_span("main.extend_decode") as extend_span:
                    extend_span.set_attributes({"pdd.extend_tokens": len(feed), "pdd.handoff_mode": stats.mode})
                    *_, (finish_reason, wait_s) = await asyncio.gather(
                        *queued, io.forward_timed(request, feed, unfeed))
                    extend_span.set_attribute("pdd.extend_wait_s", wait_s)
                # the first step after the cut is the extend-decode pass over the last eager tokens;
                # its stats go out before its token, so the gateway can mark the cut
                stats = dataclasses.replace(stats, extend_s=time.monotonic() - t0, extend_wait_s=wait_s)
                io.metrics.handoffs.labels(stats.mode).inc()
                cast(MainMetrics, io.metrics).handoff_extend.labels(stats.mode).observe(stats.extend_s)  # MD's
                await io.publish(request.events_subject, stats)
            else:
                finish_reason = await io.forward(request, feed)
            await self._publish_token(request, io, finish_reason)
            while finish_reason is None:
                finish_reason = await io.forward(request, [seq.output_ids[-1]])
                await self._publish_token(request, io, finish_reason)
            span.set_attribute("pdd.tokens", len(seq.output_ids) - first)
        return Phase.FINISHED

    async def _take_over(self, request: DecodeRequest, io: DecoderIO) -> _Cut | None:
        """Adopt RLD's eager tokens until the cut (what to do with each chunk: services/main/takeover.py).

        Chunks that arrived meanwhile are adopted together, one pass for all of them (in Catch-Up
        RLD streams a token per step), so MD never falls behind by queueing. A pass that recomputes
        without a report is queued, not awaited: the cut's pass, queued behind it, joins it in one
        row while it still waits for MD's step. None if RLD finished the request itself.
        """
        kv_wait_s = time.monotonic() - request.assigned_at
        t0 = time.monotonic()
        takeover = Takeover(request.assign.prompt_ids[-1])
        queued: list[asyncio.Future] = []
        try:
            with io.tracer.start_as_current_span("main.handoff") as span:
                if request.peer_messages.empty():  # else RLD streamed while the KV crossed: report after that pass
                    await self._report_progress(request, io, takeover)  # RLD answers with its tokens, or the cut
                while True:
                    handoff = _handoff(await request.next_peer_message(f"RLD never handed off {request.request_id}"))
                    first = takeover.adopted
                    adoption = _adopt_arrived(request, takeover, handoff)
                    if adoption.move is Move.RELAY_FINISHED:
                        span.set_attribute("pdd.relay_finished", True)
                        for future in queued:
                            future.cancel()  # MD drops the request: what is still queued need not run
                        return None
                    if adoption.move is Move.CUT:
                        break
                    await self._catch_up(request, io, takeover, queued, first)
                span.set_attributes({"pdd.eager_tokens": takeover.adopted, "pdd.handoff_mode": takeover.mode or "",
                                     "pdd.chunks": takeover.chunks})
        except BaseException:
            for future in queued:
                future.cancel()  # the request fails: what is still queued need not run
            raise
        return _Cut(adoption, queued, takeover.stats(request.request_id, kv_wait_s, time.monotonic() - t0))

    async def _catch_up(self, request: DecodeRequest, io: DecoderIO, takeover: Takeover,
                        queued: list[asyncio.Future], first: int) -> None:
        """The pass over what was adopted since `first`, if Catch-Up runs one now: queued, and awaited
        with a report to RLD when the takeover says so."""
        catch_up = takeover.catch_up_pass(request.cut_announced)
        if catch_up is Pass.COLLECT:
            return
        with io.tracer.start_as_current_span("main.catch_up_chunk") as chunk_span:
            chunk_span.set_attributes({"pdd.start": first, "pdd.tokens": takeover.adopted - first,
                                       "pdd.report": catch_up is Pass.REPORT})
            feed = takeover.take_unfed()
            if feed:
                queued.append(io.extend(request, feed))
            if catch_up is Pass.REPORT:
                await _settled(queued)
        if catch_up is Pass.REPORT:
            await self._report_progress(request, io, takeover)

    async def _report_progress(self, request: DecodeRequest, io: DecoderIO, takeover: Takeover) -> None:
        relay = request.assign.relay_instance
        assert relay is not None  # a takeover is P-RLD-MD's, whose assignment names the RLD
        await io.publish(subjects.kv_ready(relay), KVReady(request.request_id, takeover.adopted))
        takeover.reported()

    async def _publish_token(self, request: DecodeRequest, io: DecoderIO, finish_reason: str | None) -> None:
        if finish_reason is not None:
            # into the DRC before the client sees the end, so a session's next turn always finds it
            await self.keep(request, io)
        await io.publish_token(request, finish_reason)
