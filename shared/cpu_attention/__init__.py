"""pdd's decode attention kernel for CPUs: built for this machine's CPU on first use, then cached.

A decode step of a half-precision model on a CPU spends most of its time at batch 16 in attention:
torch's SDPA, called once per request per layer, reads each request's float32 KV at a third of
the bandwidth one core has. `decode_attention.cpp` serves every one-token row of a step in one
call per layer, reads K and V once per KV head for the query heads that share it, reads bfloat16
KV directly, and computes each (request, KV head) start to end on one thread, so a request's
output does not depend on who shares its step or on the thread count.

The kernel is compiled with `-march=native` by torch's extension builder (g++ and ninja; about
15 s, once) into `$TORCH_EXTENSIONS_DIR/pdd` (default `~/.cache/torch_extensions/pdd`). The build
is named after a hash of the source, torch's version, the CPU's features and the -march value, so a
cache shared between different CPUs never loads code built for another one. `PDD_CPU_ATTENTION_MARCH`
builds it for another target this CPU runs (`x86-64-v3`: AVX2; `x86-64-v4`: AVX-512), which is how
the exactness tests prove it on instruction sets other than the machine's best.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is built for
MAX_GROUP = 16  # query heads per KV head
BUILD_TIMEOUT_S = 300.0  # how long a process waits for another one's build

# rows [R, heads, head_dim] float32, each row's K and V [kv_heads, positions, head_dim], scale
DecodeAttention = Callable[[torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor], float], torch.Tensor]


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here, or disagrees with torch's attention on a probe."""


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    return head_dim in HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP


@functools.cache
def load() -> DecodeAttention:
    """The kernel's entry point, built on first call (once per machine); KernelUnavailable if it cannot be."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    name = f"pdd_decode_attention_{_build_key()}"
    directory = build_root() / name
    log.info("loading the CPU decode attention kernel (-march=%s) from %s (a first build takes about 15 s)",
             march(), directory)
    with build_lock(directory, BUILD_TIMEOUT_S):
        try:
            flags = ["-O3", f"-march={march()}", "-fopenmp-simd"]
            module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=flags, build_directory=str(directory),
                                        verbose=False)
        except Exception as exc:  # the compiler's, ninja's or the loader's error: each says why
            raise KernelUnavailable(f"could not build {SOURCE.name}: {exc}") from exc
    _check(module.decode_attention)
    return module.decode_attention


def march() -> str:
    """The -march the kernel is built for: the machine's own unless PDD_CPU_ATTENTION_MARCH names another."""
    return os.environ.get("PDD_CPU_ATTENTION_MARCH") or "native"


def build_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "pdd"


@contextmanager
def build_lock(directory: Path, timeout_s: float) -> Iterator[None]:
    """One process at a time builds or loads `directory`, waiting at most timeout_s for another.

    torch's builder has a lock of its own, a file that a killed build leaves behind and that every
    later build then waits on forever; this one is the kernel's flock, which dies with its holder,
    so under it a leftover of torch's is stale and is removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelUnavailable(f"another process has been building {directory} for over "
                                            f"{timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_features().encode())
    digest.update(march().encode())
    return digest.hexdigest()[:12]


def _cpu_features() -> str:
    """The CPU's feature list (x86 'flags', Arm 'Features'): what -march=native compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel's binary is in the venv, maybe not on it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def _check(kernel: DecodeAttention) -> None:
    """The kernel agrees with torch's SDPA on a probe, in float32 and from bfloat16 KV."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 64, generator=generator)
    kv = torch.randn(2, 2, 2, 37, 64, generator=generator)  # rows, K/V, kv_heads, positions, head_dim
    scale = 64 ** -0.5
    for dtype in (torch.float32, torch.bfloat16):
        stored = kv.to(dtype)
        got = kernel(q, [stored[r, 0] for r in range(2)], [stored[r, 1] for r in range(2)], scale)
        exact = kv.to(dtype).float()
        want = torch.cat([F.scaled_dot_product_attention(q[r].view(1, 6, 1, 64), exact[r, 0][None],
                                                         exact[r, 1][None], scale=scale,
                                                         enable_gqa=True)[0, :, 0][None] for r in range(2)])
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise KernelUnavailable(f"the built kernel differs from SDPA by {(got - want).abs().max().item():.3g} "
                                    f"({dtype})")
