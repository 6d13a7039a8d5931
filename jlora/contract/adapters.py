"""An adapter's identity, as the router and every worker check it.

- Its **name** is what clients send as `model=` (OpenAI) or `adapter` (jlora.v1):
  segments of letters, digits, '.', '_' and '-' (each starting with a letter or digit)
  separated by single '/', optionally followed by one ':tag' ("org/sql-lora:v2"), at
  most `MAX_NAME_LEN` characters. A name never denotes a path.
- Its **directory** is a PEFT adapter directory (`CONFIG_FILE` + `WEIGHTS_FILE`). A
  server with an adapters directory resolves the paths it is given inside it and
  refuses any that leads out (`..`, an absolute path elsewhere, a symlink out, also of
  the two files), so a client cannot make it open an arbitrary file.
- Its **content** is the sha256 of its `WEIGHTS_FILE`: the registry records it, a
  worker checks it against the bytes it loaded, and a mismatch is DATA_LOSS.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

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
    if not isinstance(text, str) or not text or "\x00" in text:
        raise InvalidRequest(f"{field} is empty: a PEFT adapter directory is needed", field=field)

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


def file_sha256(file: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
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
