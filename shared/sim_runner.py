"""A ModelRunner without a model (`--engine sim`): the batch engine above it stays as it is.

Each forward takes the step time a timing model gives (shared/step_timing.py): it sleeps it, or with
`--sim-wait cpu` spends it as CPU time, so that tiers sharing a host's cores slow each other down as
real engines do. It returns logits that
put a deterministic token on top: a hash of the last CONTEXT_TOKENS token ids and the position. The
KV it writes is of the model's shape and encodes each position's token id, so KV that crossed a socket
(P's prompt, MD's DRC prefix) tells the receiver's runner the context, and a handoff stays token-exact.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from shared.config import SIM_WAITS, ModelConfig
from shared.model_runner import ModelRunner, PackedRow, SequenceKV
from shared.models import load_model, pick_device
from shared.sim_checkpoint import modelled_shape
from shared.step_timing import StepRow, StepTiming, timing_for

CONTEXT_TOKENS = 4  # the next token depends on this many previous ids and the position
DIGIT = 256  # KV holds a token id as base-256 digits: whole numbers every KV dtype (bfloat16 too) keeps exactly
DIGITS = 3  # up to 2**24 ids
MARGIN = 20.0  # the deterministic token's logit above the rest: greedy and temperature 1 both pick it
log = logging.getLogger(__name__)


def next_token(context: list[int], position: int, vocab: int, avoid: frozenset[int]) -> int:
    """The sim's next token after `context` (its last ids) at `position`, never one of `avoid` (EOS)."""
    digest = hashlib.blake2b(repr((context[-CONTEXT_TOKENS:], position)).encode(), digest_size=8).digest()
    token = int.from_bytes(digest, "little") % vocab
    while token in avoid:
        token = (token + 1) % vocab
    return token


_CPU_WORK = bytes(64 * 1024)  # what spend_cpu hashes: in L2, and hashlib lets go of the GIL for it


def spend_cpu(seconds: float) -> None:
    """Keep this thread busy for `seconds` of its own CPU time, the GIL free meanwhile (as it is in a
    torch kernel): on a contended core the wall time stretches, as a real forward's would."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        hashlib.sha256().update(_CPU_WORK)


class SimRunner(ModelRunner):
    """ModelRunner's interface (KV allocation, growth, copies are its own code) with a modelled forward."""

    def __init__(self, path: Path, dtype: str, device: str, timing: StepTiming, wait: str = "sleep") -> None:
        if wait not in SIM_WAITS:
            raise ValueError(f"--sim-wait: one of {', '.join(SIM_WAITS)}, not {wait!r}")
        self.wait = wait
        config = json.loads((path / "config.json").read_text())
        self.config = AutoConfig.from_pretrained(path)
        self.timing = timing
        self.device = pick_device(device)
        self.dtype = getattr(torch, dtype)
        self.kv_dtype = self.dtype
        self.decode_attention = None
        self.max_context_tokens = int(config.get("max_position_embeddings", 2048))
        self.num_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or heads)
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        self.vocab = int(config["vocab_size"])
        eos = config.get("eos_token_id")
        self.avoid = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # a fixed spread of the other tokens' logits, rolled per position, so a grammar that masks the top
        # token still finds a varied, deterministic runner-up
        self.background = torch.randn(self.vocab, generator=torch.Generator().manual_seed(0))
        self.modelled_s = 0.0  # every step's modelled time, summed
        self.steps = 0
        log.info("simulated engine: %s, KV in %s on %s", type(timing).__name__, self.dtype, self.device)

    def stats(self) -> dict[str, int | float]:
        return {"sim_modelled_s": self.modelled_s, "sim_steps": self.steps}

    def forward_packed(self, rows: list[PackedRow]) -> torch.Tensor:
        started, cpu_started = time.perf_counter(), time.thread_time()
        step_s = self.timing.step_s([StepRow(r.kv.length, len(r.token_ids),
                                             len(r.token_ids) if r.every_logit else int(r.want_logits))
                                     for r in rows])
        logits: list[torch.Tensor] = []
        for row in rows:
            n = len(row.token_ids)
            if row.kv.length + n > row.kv.capacity:
                raise ValueError(f"KV holds {row.kv.length} of {row.kv.capacity} positions; {n} more do not fit")
            context = self._ids(row.kv, max(0, row.kv.length - CONTEXT_TOKENS), row.kv.length)
            self._write(row.kv, row.token_ids)
            wanted = range(n) if row.every_logit else [n - 1] if row.want_logits else []
            for i in wanted:
                position = row.kv.length - n + i
                seen = context + row.token_ids[:i + 1]
                logits.append(self._logits(next_token(seen, position, self.vocab, self.avoid), position))
        self.modelled_s += step_s
        self.steps += 1
        if self.wait == "cpu":
            spend_cpu(step_s - (time.thread_time() - cpu_started))
        else:
            left_s = step_s - (time.perf_counter() - started)
            if left_s > 0:
                time.sleep(left_s)  # the engine thread's, as a real forward would block it
        if not logits:
            return torch.empty((0, self.vocab))
        return torch.stack(logits)

    def _logits(self, token: int, position: int) -> torch.Tensor:
        row = torch.roll(self.background, position % self.vocab)
        row[token] = float(row.max()) + MARGIN
        return row

    def _write(self, kv: SequenceKV, token_ids: list[int]) -> None:
        """Positions kv.length onwards get token_ids: every value of a position is a digit of its id."""
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long)
        digits = torch.stack([(ids // DIGIT ** d) % DIGIT for d in range(DIGITS)], dim=1)  # [n, DIGITS]
        pattern = digits.repeat(1, -(-self.head_dim // DIGITS))[:, :self.head_dim].to(kv.data.dtype)
        kv.data[:, :, :, kv.length:kv.length + n] = pattern.to(kv.data.device)  # broadcast over layers, K/V, heads
        kv.length += n

    @staticmethod
    def _ids(kv: SequenceKV, start: int, end: int) -> list[int]:
        digits = kv.data[0, 0, 0, start:end, :DIGITS].to(torch.long).cpu()
        return (digits * torch.tensor([DIGIT ** d for d in range(DIGITS)])).sum(dim=1).tolist()


def build_runner(config: ModelConfig, path: Path, row_invariant: bool = True) -> ModelRunner:
    """The runner `--engine` asks for: the model's own, or the simulated one timed by --sim-profile/--sim-device."""
    if config.engine == "real":
        return ModelRunner(load_model(path, config.dtype, config.device), config.decode_attention, row_invariant)
    model_config = modelled_shape(json.loads((path / "config.json").read_text()))  # a sim checkpoint's shape
    timing = timing_for(model_config, getattr(torch, config.dtype).itemsize, config.sim_device, config.sim_profile)
    return SimRunner(path, config.dtype, config.device, timing, config.sim_wait)
