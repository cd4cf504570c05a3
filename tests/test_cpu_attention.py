"""pdd's CPU decode attention kernel: torch's SDPA result, per row whoever shares the call, and what the
runner does with it (shared/cpu_attention, shared/model_runner.py)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from shared import cpu_attention
from shared.cpu_attention import KernelUnavailable
from shared.model_runner import KERNEL_ROW_TOKENS, ModelRunner, PackedRow, pick_decode_attention
from shared.models import load_model

pytestmark = pytest.mark.exactness


@pytest.fixture(scope="module")
def kernel():
    try:
        return cpu_attention.load()
    except KernelUnavailable as exc:  # no C++ compiler on this machine: the runner falls back to SDPA
        pytest.skip(str(exc))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's attention of one row: q [heads, d] over k, v [kv_heads, L, d]."""
    heads, d = q.shape
    return F.scaled_dot_product_attention(q.view(1, heads, 1, d), k.float()[None], v.float()[None], scale=scale,
                                          enable_gqa=True)[0, :, 0]


def buffers(lengths: list[int], kv_heads: int, dim: int, dtype: torch.dtype, capacity: int = 80) -> list:
    """Each row's K and V as the runner holds them: narrowed views of one [2, kv_heads, capacity, d] buffer."""
    generator = torch.Generator().manual_seed(len(lengths) * 1000 + dim)
    data = [torch.randn(2, kv_heads, capacity, dim, generator=generator).to(dtype) for _ in lengths]
    return [(kv[0].narrow(1, 0, n), kv[1].narrow(1, 0, n)) for kv, n in zip(data, lengths)]


@pytest.mark.parametrize("dim", cpu_attention.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_what_sdpa_computes(kernel, dim, heads, kv_heads, dtype) -> None:
    lengths = [1, 7, 64, 80]
    kv = buffers(lengths, kv_heads, dim, dtype)
    q = torch.randn(len(lengths), heads, dim)
    scale = dim ** -0.5
    got = kernel(q, [k for k, _ in kv], [v for _, v in kv], scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    for row, (k, v) in enumerate(kv):
        torch.testing.assert_close(got[row], sdpa(q[row], k, v, scale), rtol=1e-5, atol=1e-6)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it_or_the_thread_count(kernel) -> None:
    lengths = [3, 200, 17, 1, 90, 512, 40, 41]
    kv = buffers(lengths, 3, 64, torch.bfloat16, capacity=600)
    q = torch.randn(len(lengths), 9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel(q[r:r + 1].clone(), [kv[r][0]], [kv[r][1]], 0.125)[0] for r in range(len(lengths))]
        torch.set_num_threads(2)
        together = kernel(q, [k for k, _ in kv], [v for _, v in kv], 0.125)
    finally:
        torch.set_num_threads(threads)
    for r in range(len(lengths)):
        assert torch.equal(together[r], alone[r]), f"row {r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_extends_tokens_each_get_what_they_get_alone(kernel, dtype) -> None:
    """A row of several tokens (MD's extend of RLD's eager tokens) comes as consecutive views of one
    KV buffer, each a position longer, between other requests' rows: each token's output is, bit for
    bit, what it gets alone, the one-token decode step RLD made it in."""
    generator = torch.Generator().manual_seed(7)
    buffer = torch.randn(2, 3, 700, 64, generator=generator).to(dtype)
    other = buffers([33], 3, 64, dtype)[0]
    extend = [(buffer[0].narrow(1, 0, n), buffer[1].narrow(1, 0, n)) for n in range(600, 637)]
    rows = [other, *extend, other, *extend[:5]]  # a run, a lone row, and a second run of the same request
    q = torch.randn(len(rows), 9, 64, generator=generator)
    together = kernel(q, [k for k, _ in rows], [v for _, v in rows], 0.125)
    for r, (k, v) in enumerate(rows):
        assert torch.equal(together[r], kernel(q[r:r + 1].clone(), [k], [v], 0.125)[0]), f"row {r}"


def test_bfloat16_kv_gives_the_result_of_the_same_values_held_in_float32(kernel) -> None:
    k, v = buffers([50], 2, 32, torch.bfloat16)[0]
    q = torch.randn(1, 4, 32)
    assert torch.equal(kernel(q, [k], [v], 0.2), kernel(q, [k.float()], [v.float()], 0.2))


@pytest.mark.parametrize("case,message", [
    ("q not float32", "float32"),
    ("rows and KV differ", "one K and one V per row"),
    ("heads not a multiple", "multiple of KV heads"),
    ("head_dim not built", "is not built"),
    ("K and V lengths differ", "same number of positions"),
    ("a transposed K", "contiguous"),
    ("mixed KV dtypes", "one dtype"),
])
def test_bad_input_is_refused_with_a_reason(kernel, case, message) -> None:
    q = torch.randn(1, 4, 16)
    k, v = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    args = {
        "q not float32": (q.double(), [k], [v]),
        "rows and KV differ": (q, [k, k], [v, v]),
        "heads not a multiple": (torch.randn(1, 5, 16), [k], [v]),
        "head_dim not built": (torch.randn(1, 4, 24), [torch.randn(2, 5, 24)], [torch.randn(2, 5, 24)]),
        "K and V lengths differ": (q, [k], [v[:, :4]]),
        "a transposed K": (q, [torch.randn(2, 16, 5).transpose(1, 2)], [v]),
        "mixed KV dtypes": (q, [k], [v.to(torch.bfloat16)]),
    }[case]
    with pytest.raises(RuntimeError, match=message):
        kernel(*args, 0.25)


def test_the_runner_takes_the_kernel_for_a_half_precision_model_on_a_cpu_only(kernel) -> None:
    cpu = torch.device("cpu")
    assert pick_decode_attention("auto", cpu, torch.bfloat16, 9, 3, 64) is kernel
    assert pick_decode_attention("auto", cpu, torch.float32, 9, 3, 64) is None, "float32 keeps transformers' SDPA"
    assert pick_decode_attention("kernel", cpu, torch.float32, 9, 3, 64) is kernel
    assert pick_decode_attention("sdpa", cpu, torch.bfloat16, 9, 3, 64) is None
    assert pick_decode_attention("auto", cpu, torch.bfloat16, 9, 3, 96) is None, "a head size it is not built for"
    with pytest.raises(KernelUnavailable, match="head_dim"):
        pick_decode_attention("kernel", cpu, torch.bfloat16, 9, 3, 96)
    with pytest.raises(KernelUnavailable, match="meta"):
        pick_decode_attention("kernel", torch.device("meta"), torch.bfloat16, 9, 3, 64)
    with pytest.raises(ValueError, match="one of auto, kernel, sdpa"):
        pick_decode_attention("flash", cpu, torch.bfloat16, 9, 3, 64)


def test_a_bfloat16_runner_on_the_kernel_keeps_bfloat16_kv_and_decodes_as_sdpa_does(kernel, tiny_path) -> None:
    """Same model, same prompt: the kernel's runner and SDPA's agree on the logits of every decode step
    within bfloat16's rounding, and a request's tokens are the same alone and batched with others."""
    runner = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"))
    reference = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"), decode_attention="sdpa")
    assert runner.decode_attention is kernel and reference.decode_attention is None
    assert runner.kv_dtype == torch.bfloat16 and reference.kv_dtype == torch.float32
    prompts = [[5, 17, 99, 3, 250, 8, 41], [7] * 30, list(range(300, 340))]

    def decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
        kvs = [runner.new_kv(len(p) + steps) for p in prompts]
        logits = runner.forward_packed([PackedRow(kv, p, True) for kv, p in zip(kvs, prompts)])
        tokens = [[int(row.argmax())] for row in logits]
        seen = []
        for _ in range(steps - 1):
            logits = runner.forward_packed([PackedRow(kv, t[-1:], True) for kv, t in zip(kvs, tokens)])
            seen.append(logits.float())
            for t, row in zip(tokens, logits):
                t.append(int(row.argmax()))
        return tokens, seen

    batched, logits = decode(runner, prompts, 12)
    _, reference_logits = decode(reference, prompts, 12)
    for got, want in zip(logits, reference_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=0.1)
    for prompt, tokens in zip(prompts, batched):
        assert decode(runner, [prompt], 12)[0] == [tokens], "alone as in the batch"


def test_a_step_mixing_decode_rows_and_a_prompt_gives_each_row_what_it_gets_alone(kernel, tiny_path) -> None:
    runner = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"))
    decoding = [[5, 17, 99, 3], list(range(300, 333))]
    prompt = list(range(40, 61))

    def step(together: bool) -> list[torch.Tensor]:
        kvs = [runner.new_kv(64) for _ in decoding]
        for kv, ids in zip(kvs, decoding):
            runner.forward(kv, ids)
        rows = [PackedRow(kv, [11], True) for kv in kvs] + [PackedRow(runner.new_kv(64), prompt, True)]
        if together:
            return list(runner.forward_packed(rows))
        return [runner.forward_packed([row])[0] for row in rows]

    for together, alone in zip(step(True), step(False)):
        assert torch.equal(together, alone)


def test_a_build_killed_midway_leaves_no_lock_that_later_starts_wait_on(tmp_path) -> None:
    """torch's own lock file, left by a killed build, is removed under the kernel's flock."""
    directory = tmp_path / "pdd_decode_attention_x"
    directory.mkdir()
    (directory / "lock").write_text("")
    with cpu_attention.build_lock(directory, timeout_s=1.0):
        assert not (directory / "lock").exists()


def test_a_build_held_by_another_process_is_waited_for_within_a_deadline(tmp_path) -> None:
    directory = tmp_path / "pdd_decode_attention_x"
    lock = directory.with_name(directory.name + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)")],
        stdout=subprocess.PIPE, text=True)
    try:
        directory.mkdir()
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(KernelUnavailable, match="another process has been building"):
            with cpu_attention.build_lock(directory, timeout_s=0.5):
                pass
        assert time.monotonic() - started < 10
    finally:
        holder.kill()
        holder.wait()
    with cpu_attention.build_lock(directory, timeout_s=5.0):  # the holder's death released it
        pass


@pytest.mark.parametrize("eager", [1, 7, KERNEL_ROW_TOKENS])
def test_md_recomputing_rlds_eager_tokens_in_one_pass_gets_rlds_kv_bit_for_bit(kernel, tiny_path, eager) -> None:
    """The Extend-Decode handoff in bfloat16 on a CPU: RLD made `eager` tokens one step at a time, MD
    feeds them in one forward. Rows of up to KERNEL_ROW_TOKENS tokens attend through the kernel a
    token at a time, and bfloat16's packed linears give every row the same result at any batch size,
    so MD ends with RLD's KV exactly, and picks RLD's next token from RLD's logits."""
    runner = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"))
    prompt = list(range(500, 540))
    relay = runner.new_kv(len(prompt) + eager + 1)
    logits = runner.forward(relay, prompt)
    tokens = []
    for _ in range(eager):
        tokens.append(int(logits.argmax()))
        logits = runner.forward(relay, tokens[-1:])
    main = runner.new_kv(len(prompt) + eager + 1)
    runner.forward(main, prompt)
    main_logits = runner.forward(main, tokens)
    assert main.length == relay.length
    assert torch.equal(main.data[:, :, :, :main.length], relay.data[:, :, :, :relay.length])
    assert torch.equal(main_logits, logits)


def test_a_catch_up_chunk_that_samples_nothing_extends_a_bfloat16_decoders_kv(tiny_path) -> None:
    """MD extends its KV by a Catch-Up chunk without sampling: the LM head then gets no row, which
    the planned linears must pass through (it raised once: a plan with nothing to split)."""
    runner = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"))
    prompt, chunk = list(range(500, 540)), list(range(700, 707))
    whole = runner.new_kv(64)
    runner.forward(whole, prompt)
    want = runner.forward(whole, chunk)
    kv = runner.new_kv(64)
    runner.forward(kv, prompt)
    assert runner.forward_packed([PackedRow(kv, chunk[:-1], want_logits=False)]).shape[0] == 0
    got = runner.forward(kv, chunk[-1:])
    assert torch.equal(got, want)
    assert torch.equal(kv.data[:, :, :, :kv.length], whole.data[:, :, :, :whole.length])
