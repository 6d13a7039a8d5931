"""An adapter's identity, as the router and every worker check it.

- Its **name** is what clients send as `model=` (OpenAI) or `adapter` (jlora.v1):
  segments of letters, digits, '.', '_' and '-' (each starting with a letter or digit)
  separated by single '/', optionally followed by one ':tag' ("org/sql-lora:v2"), at
  most `MAX_NAME_LEN` characters. A name never denotes a path.
- Its **directory** is a PEFT adapter directory (`CONFIG_FILE` + `WEIGHTS_FILE`). A
  server with an adapters directory resolves the paths it is given inside it and
  refuses any that leads out (`..`, an absolute path elsewhere, a symlink out, also of
  the two files), so a client cannot make it open an arbitrary file.
- Its **content** is the sha256 of its `WEIGHTS_FILE` (`sha256_of`, the one way jlora
  hashes): the registry records it, a worker checks it against the bytes it loaded, and
  a mismatch is DATA_LOSS.
- What it **is**, `Adapter`: one record from the registry to the device (name, path,
  content hash, rank, alpha, targets, sizes), filled in as it goes: read from its
  directory (`jlora.contract.peft`), registered, staged into host memory (host and
  device bytes), reported with where it is (`jlora.engine.api.AdapterInfo`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

from configs.engine import LORA_TARGETS as TARGETS
from jlora.contract.errors import DataLoss, FailedPrecondition, InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_LEN = 128
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
NAME_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*(?::{_SEGMENT})?")
NAME_RULE = (
    f"at most {MAX_NAME_LEN} letters, digits, '.', '_', '-', in segments that start with "
    "a letter or digit, separated by single '/', with an optional ':tag' (org/name:v2)"
)


# The Hugging Face module that holds each projection inside a decoder layer.
MODULE_OF = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class AdapterError(InvalidRequest):
    """A bad adapter (or bad arguments for one); the message names the file and the
    entry at fault. As a request error its field is the adapter's `path`."""

    def __init__(self, message: str, *, field: str | None = "path") -> None:
        super().__init__(message, field=field)


def canonical_targets(names: Iterable[str]) -> tuple[str, ...]:
    """The target projections `names` denote, in `TARGETS` order, without repeats.

    Accepted: a projection name ("q_proj") or a module path ending in its module and name
    ("self_attn.q_proj", or "model.layers.3.self_attn.q_proj" as PEFT writes "all-linear"
    out, one name per layer). Whether the adapter holds every layer of each target is
    its tensors' business (`jlora.contract.peft.check_tensor_names`).
    """
    if isinstance(names, str):
        raise AdapterError(f"{names!r} is a string; expected a list of target module names")
    found = set()
    for name in names:
        target = name.rsplit(".", 1)[-1] if isinstance(name, str) else None
        qualified = target in MODULE_OF and name.endswith(f"{MODULE_OF[target]}.{target}")
        if target not in MODULE_OF or not (name == target or qualified):
            raise AdapterError(
                f"target module {name!r} is not supported; supported: {', '.join(TARGETS)} "
                "(lm_head, embed_tokens and regular expressions are not)"
            )
        found.add(target)
    if not found:
        raise AdapterError("no target modules")
    return tuple(t for t in TARGETS if t in found)


def check_adapter_name(name: object, *, base_model: str | None = None, field: str = "name") -> str:
    """`name` if it may name an adapter (and is not the base model's id); else
    InvalidRequest naming `field`."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{field} is empty: an adapter needs a name", field=field)
    if len(name) > MAX_NAME_LEN or not NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"{field}={name[: MAX_NAME_LEN + 1]!r} must be {NAME_RULE}", field=field
        )
    if name == base_model:
        raise InvalidRequest(f"{field}={name!r} is the base model's id", field=field)
    return name


def resolve_adapter_dir(
    path: str | os.PathLike[str],
    adapters_dir: str | os.PathLike[str] | None,
    *,
    field: str = "path",
) -> Path:
    """The real PEFT directory `path` names, or InvalidRequest naming `field`.

    With `adapters_dir`, `path` is relative to it (an absolute path must lie inside it)
    and is refused if it contains '..' or resolves, through symlinks, outside it or to
    it; so are its CONFIG_FILE and WEIGHTS_FILE if they link out. Symlinks that stay
    inside are followed. Without one, `path` is taken as given. Either way it must be
    an existing directory.
    """
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise InvalidRequest(f"{field} is empty: a PEFT adapter directory is needed", field=field)
    if "\x00" in text:
        raise InvalidRequest(
            f"{field}={text!r} contains a NUL character, which no path may hold", field=field
        )

    def refuse(reason: str) -> InvalidRequest:
        return InvalidRequest(f"{field}={text!r} {reason}", field=field)

    if adapters_dir is None:
        real = Path(text).expanduser().resolve()
        if not real.exists():
            raise refuse("does not exist")
        if not real.is_dir():
            raise refuse("is not a directory (expected a PEFT adapter directory)")
        return real
    if ".." in Path(text).parts:
        raise refuse("must not contain '..'")
    try:
        root = Path(adapters_dir).resolve(strict=True)
    except OSError as err:
        raise FailedPrecondition(
            f"the adapters directory {os.fspath(adapters_dir)} is unusable ({err})"
        ) from None
    try:
        real = (root / text).resolve(strict=True)
        members = {member: (real / member).resolve() for member in (CONFIG_FILE, WEIGHTS_FILE)}
    except FileNotFoundError:
        raise refuse(f"does not exist in the adapters directory {root}") from None
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop (Python < 3.13)
        raise refuse(f"cannot be resolved ({err})") from None
    if real == root or not real.is_relative_to(root):
        raise refuse(f"resolves to {real}, outside the adapters directory {root}")
    for member, target in members.items():
        if not target.is_relative_to(root):
            raise refuse(f"has {member} linking to {target}, outside the adapters directory")
    if not real.is_dir():
        raise refuse("is not a directory (expected a PEFT adapter directory)")
    return real


def relative_to_adapters_dir(directory: Path, adapters_dir: str | os.PathLike[str]) -> str:
    """A resolved adapter directory as the path other machines resolve (`as_posix`)."""
    return directory.relative_to(Path(adapters_dir).resolve()).as_posix()


def sha256_of(*parts: bytes | str | os.PathLike[str]) -> str:
    """Hex sha256 of `parts` in order: bytes as they are, a path as its file's bytes (read
    in 1 MiB chunks). The one way jlora hashes an adapter's content."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, bytes | bytearray | memoryview):
            digest.update(part)
            continue
        with open(part, "rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def check_sha256(expected: str | None, actual: str, *, adapter: str, source: object) -> None:
    """DataLoss (field "sha256") unless `actual`, the hash of the bytes read from
    `source`, is `expected` (nothing expected: nothing to check)."""
    if expected and actual.lower() != expected.lower():
        raise DataLoss(
            f"adapter {adapter!r}: {source} has sha256 {actual.lower()}, but "
            f"sha256={expected.lower()!r} was expected (the registry's); the file is corrupt "
            "or was replaced: register it again",
            field="sha256",
            reason="CHECKSUM_MISMATCH",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adapter:
    """One LoRA adapter, as the registry, the router, the orchestrator and the device
    engine know it: the same record all the way, its later fields filled in as it goes.

    name: as clients name it (`check_adapter_name`); "" while only its directory is known.
    path: its PEFT directory (in the registry: relative to the adapters directory).
    rank, alpha, use_rslora: PEFT's r, lora_alpha and use_rslora (`scaling` follows).
    targets: the adapted projections, normalised to the canonical order (`canonical_targets`).
    base_model: the base model it adapts: in the registry, the id the workers serve; read
        from a directory, its `base_model_name_or_path` (None if unset).
    sha256, size_bytes: of its WEIGHTS_FILE ("" and 0 until the file is read).
    host_bytes, device_bytes: in the host store, and on the device at its own rank (what
        the memory pool charges); 0 until a worker stages it.
    created_at: when it was registered, seconds since the epoch (0: not registered).
    """

    name: str = ""
    path: str = ""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    base_model: str | None = None
    sha256: str = ""
    size_bytes: int = 0
    host_bytes: int = 0
    device_bytes: int = 0
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise InvalidRequest(f"rank={self.rank!r} must be a positive integer", field="rank")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise InvalidRequest(f"alpha={alpha!r} must be a positive number", field="alpha")
        if not math.isfinite(alpha) or alpha <= 0:
            raise InvalidRequest(f"alpha={alpha!r} must be a positive number", field="alpha")
        object.__setattr__(self, "alpha", float(alpha))
        if not isinstance(self.use_rslora, bool):
            raise InvalidRequest(
                f"use_rslora={self.use_rslora!r} must be a bool", field="use_rslora"
            )
        try:
            targets = canonical_targets(self.targets)
        except AdapterError as err:
            raise AdapterError(f"targets={self.targets!r}: {err}", field="targets") from None
        object.__setattr__(self, "targets", targets)

    @property
    def scaling(self) -> float:
        """PEFT's rule (peft 0.21, `peft/tuners/lora/layer.py`, `LoraLayer.update_layer`):
        lora_alpha / sqrt(r) with rank-stabilised LoRA (`use_rslora`), lora_alpha / r
        otherwise."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank
