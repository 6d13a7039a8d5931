"""transformers' own reading of a GGUF file (the PyTorch baseline's model and the tests'
oracle), converted once per machine.

transformers reads a GGUF file in Python: SmolLM2-135M's takes about 30 s on one core
(its tokenizer's 49,152 tokens and merges field by field, a tensor-name map rebuilt for
each of its 272 tensors), and the tests, the baseline server and the benches each loaded
it again. The first load here saves transformers' result, the model or the tokenizer,
as a plain transformers directory (safetensors; tokenizer files) under `.cache/hf/`,
keyed by the file's name, size and modification time; every later load reads that in
about a second. A directory is written aside and renamed into place under a file lock,
so processes that start together convert once and never read half a conversion.

The model is saved in fp32 as transformers dequantized it, so loading it in any dtype
rounds once, as loading the GGUF file in that dtype does.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from bench.lib.processes import ROOT

CACHE = Path(os.environ.get("JLORA_HF_CACHE", ROOT / ".cache" / "hf"))


def model(gguf_path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' causal LM of the GGUF file, in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(converted(gguf_path, "model")), dtype=dtype)
    return loaded.eval()


def tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer of the GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted(gguf_path, "tokenizer")))


def converted(gguf_path: Path, part: str) -> Path:
    """The directory holding transformers' conversion of the GGUF file's "model" or
    "tokenizer" (made on first use)."""
    stat = gguf_path.stat()
    target = CACHE / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}" / part
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.is_dir():
            partial = target.with_name(part + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _SAVE[part](gguf_path, partial)
            partial.rename(target)
    return target


def _where(gguf_path: Path) -> dict[str, str]:
    """transformers' arguments naming the GGUF file."""
    return dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)


def _save_model(gguf_path: Path, where_to: Path) -> None:
    """transformers' load of the GGUF file's model in fp32, saved to `where_to`."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):  # dequantization's tqdm bar
        loaded = AutoModelForCausalLM.from_pretrained(**_where(gguf_path), dtype=torch.float32)
    # transformers tags a model read from GGUF as quantized and will not save it, though
    # it holds plain dequantized tensors: the tag goes, the tensors stay.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    loaded.save_pretrained(str(where_to))


def _save_tokenizer(gguf_path: Path, where_to: Path) -> None:
    """transformers' load of the GGUF file's tokenizer, saved to `where_to`."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(**_where(gguf_path)).save_pretrained(str(where_to))


_SAVE = {"model": _save_model, "tokenizer": _save_tokenizer}  # `converted`'s parts
