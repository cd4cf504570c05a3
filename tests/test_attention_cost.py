"""scripts/measure_attention_cost.py: the fit recovers the engine's cost model's C, and the script
measures one for a real (tiny) model."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measure_attention_cost.py"


def _script():
    spec = importlib.util.spec_from_file_location("measure_attention_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fit_recovers_c_from_times_that_follow_the_engines_cost_model():
    chunk, c, ms_per_token = 256, 1100.0, 1.6
    contexts = [0, 1024, 2048, 3072]
    times = [ms_per_token * chunk * (1 + (n + chunk / 2) / c) for n in contexts]
    assert _script().attention_cost_tokens(contexts, times, chunk) == pytest.approx(c)


def test_a_chunk_whose_time_does_not_grow_with_context_is_refused():
    with pytest.raises(ValueError, match="attention is free"):
        _script().attention_cost_tokens([0, 1024], [400.0, 400.0], 256)


def test_the_script_measures_a_value_for_the_tiny_model(tiny_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--chunk-tokens", "64",
                           "--contexts", "0,1536", "--repeats", "5", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert re.search(r"over +1536 cached positions: +[\d.]+ ms", out)
    assert int(re.search(r"^--attention-cost-tokens (\d+)$", out, re.M).group(1)) >= 1
