"""The gateway never runs a model: it starts without torch, which costs each model process about 1.5 s
of CPU to import (and every test stack starts a gateway)."""
from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import services.gateway.__main__
from shared.models import load_tokenizer, resolve_model
load_tokenizer(resolve_model(sys.argv[1])).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
heavy = sorted(m for m in ("torch", "transformers.modeling_utils", "llguidance.hf") if m in sys.modules)
print(" ".join(heavy) or "none")
"""


def test_the_gateway_and_its_tokenizer_load_without_torch(tiny_path):
    done = subprocess.run([sys.executable, "-c", CHECK, str(tiny_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["none"]
