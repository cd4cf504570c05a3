"""Tensors in, tokens out: forward passes over a Hugging Face causal LM with a per-request cache.

Everything here is blocking and runs on the engine thread. KV moves in and out as one tensor
of shape [layers, 2 (K, V), kv_heads, tokens, head_dim], the layout of the KV wire format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from shared.sampling import SamplingParams, sample_token


@dataclass
class DecodeSequence:
    """One request's state on a decoder: its cache and the output tokens it knows so far."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    cache: DynamicCache
    max_context_tokens: int
    output_ids: list[int] = field(default_factory=list)

    def finish_reason(self) -> str | None:
        if self.output_ids and self.sampling.is_stop(self.output_ids[-1]):
            return "stop"
        if len(self.output_ids) >= self.sampling.max_tokens:
            return "length"
        if len(self.prompt_ids) + len(self.output_ids) >= self.max_context_tokens:
            return "length"
        return None


class ModelRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_context_tokens = int(getattr(model.config, "max_position_embeddings", 2048))

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def cache_from_kv(self, kv: torch.Tensor) -> DynamicCache:
        """A fresh cache holding kv [layers, 2, kv_heads, tokens, head_dim] as positions 0..tokens-1."""
        cache = self.new_cache()
        kv = kv.to(device=self.device, dtype=self.dtype)
        for layer in range(kv.shape[0]):
            cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        return cache

    @staticmethod
    def kv_slice(cache: DynamicCache, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of every layer as [layers, 2, kv_heads, tokens, head_dim]."""
        return torch.stack([
            torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
            for layer in cache.layers
        ])

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, token_ids: list[int]) -> torch.Tensor:
        """Append token_ids to the cache; return the logits after the last one, shape [vocab]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def decode_step(self, seq: DecodeSequence, feed_ids: list[int]) -> tuple[int, str | None]:
        """Feed the tokens the cache lacks (one, or several after a handoff); sample the next one."""
        logits = self.forward(seq.cache, feed_ids)
        token = sample_token(logits, seq.sampling, len(seq.output_ids))
        seq.output_ids.append(token)
        return token, seq.finish_reason()
