"""A checkpoint directory for the simulated engine: a model shape's config.json (shared/sim_shapes/, or
any config.json) beside a real checkpoint's tokenizer, and no weights, so `--engine sim` serves a model
larger than the checkpoint. Its KV layout is what crosses the sockets: the shape's own, or one carrying
1/--kv-byte-scale of its bytes per token; the shape itself stays in the config for the step timing.
The real engine cannot load it (there are no weights). docs/sim.md, "Larger models".
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

SHAPES_DIR = Path(__file__).parent / "sim_shapes"
SHAPE_KEY = "_pdd_sim_shape"  # the modelled shape, which the step timing reads (shared/sim_runner.build_runner)
SCALE_KEY = "_pdd_kv_byte_scale"  # modelled KV bytes per carried byte
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta")
TOKENIZER_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")  # the tokens it can spell
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt")
MIN_HEAD_DIM = 4  # the sim writes a token id's 3 base-256 digits into each position's values


def load_shape(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, shape) of a name under shared/sim_shapes/ or a config.json's path."""
    path = Path(spec)
    if not path.is_file():
        path = SHAPES_DIR / (spec if spec.endswith(".json") else spec + ".json")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))
        raise FileNotFoundError(f"--sim-shape {spec!r}: not a file, nor one of {known}")
    config = json.loads(path.read_text())
    return path.stem if path.parent == SHAPES_DIR else path.parent.name, _shape_of(config)


def _shape_of(config: dict[str, Any]) -> dict[str, Any]:
    shape = {key: config[key] for key in SHAPE_KEYS if key in config}
    heads = int(shape["num_attention_heads"])
    shape.setdefault("num_key_value_heads", heads)
    shape.setdefault("head_dim", int(shape["hidden_size"]) // heads)
    return shape


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def carried_kv(layers: int, kv_heads: int, head_dim: int, scale: int) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) carrying 1/scale of the bytes per token: each prime factor of scale
    divides the head dim (down to MIN_HEAD_DIM), else the KV heads, else the layers."""
    if scale < 1:
        raise ValueError(f"--kv-byte-scale must be a whole number >= 1, got {scale}")
    dims = {"head_dim": head_dim, "kv_heads": kv_heads, "layers": layers}
    floors = {"head_dim": MIN_HEAD_DIM, "kv_heads": 1, "layers": 1}
    for p in _prime_factors(scale):
        name = next((n for n, d in dims.items() if d % p == 0 and d // p >= floors[n]), None)
        if name is None:
            raise ValueError(f"--kv-byte-scale {scale}: a {layers}x{kv_heads}x{head_dim} KV layout does not divide "
                             f"by it (its factor {p} divides none of them); try a power of two")
        dims[name] //= p
    return dims["layers"], dims["kv_heads"], dims["head_dim"]


def sim_checkpoint(base: Path, shape: str = "", kv_byte_scale: int = 1, home: Path | None = None) -> Path:
    """The directory `--model` takes for a sim of `shape` (default: the base checkpoint's own) with the
    base's tokenizer and KV scaled by kv_byte_scale; made once under home (PDD_HOME), then reused."""
    from shared.models import made_once, pdd_home, served_model_name, write_atomically

    base_config = json.loads((base / "config.json").read_text())
    if shape:
        name, modelled = load_shape(shape)
    else:
        name, modelled = served_model_name(base), _shape_of(base_config)
    layers, kv_heads, head_dim = carried_kv(int(modelled["num_hidden_layers"]), int(modelled["num_key_value_heads"]),
                                            int(modelled["head_dim"]), kv_byte_scale)
    config = {**modelled, **{k: base_config[k] for k in TOKENIZER_KEYS if k in base_config},
              "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "architectures": ["LlamaForCausalLM"], "_pdd_name": f"sim-{name}", SHAPE_KEY: modelled,
              SCALE_KEY: kv_byte_scale}
    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode() + str(base.resolve()).encode()).hexdigest()[:10]
    target = (home or pdd_home()) / "sim-checkpoints" / f"sim-{name}-kv{kv_byte_scale}-{digest}"

    def make(target: Path) -> None:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            for item in base.iterdir():
                if item.is_file() and item.name != "config.json" and not any(item.match(w) for w in WEIGHTS):
                    shutil.copy2(item, tmp)
            (Path(tmp) / "config.json").write_text(text)
            write_atomically(Path(tmp), target)

    return made_once(target, "config.json", make)  # one maker at a time; the others find it made


def modelled_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The shape a checkpoint's steps are timed for: the modelled one of a sim checkpoint, else its own."""
    return config.get(SHAPE_KEY, config)


def kv_byte_scale(config: dict[str, Any]) -> int:
    return int(config.get(SCALE_KEY, 1))
