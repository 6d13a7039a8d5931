"""The global LoRA adapter registry: one SQLite file the router and the workers share.

Toppings §6 ("Scheduler & global LoRA registry") keeps the adapters every server may
serve in SQLite; jlora does the same. An entry says what an adapter is (name, base
model, rank, alpha, rsLoRA, target modules) and where its weights are: `path`, a PEFT
directory relative to the adapters directory, and `sha256`/`size_bytes` of its
`adapter_model.safetensors`, the adapter's identity (`jlora.contract.adapters`). An
entry is the `Adapter` record every layer uses (`created_at` set).

The life of an adapter:

1. Registration (through the router): `adapter_from_directory` resolves the path inside
   the adapters directory (`contract.adapters.resolve_adapter_dir` refuses `..` and
   symlinks that lead out of it), reads the adapter's rank, targets and hash;
   `register` checks and stores the entry, refusing a duplicate name (AdapterExists) or
   a bad field (InvalidEntry, which names the field).
2. Routing: the router reads `get(name)` for the adapter's rank (the rank-aware policy
   needs it) and `list()` for `/v1/models`.
3. Loading (a worker): the directory is resolved again and the hash of the bytes the
   worker loaded is compared with the entry's (`jlora.contract.adapters.check_sha256`):
   a corrupt or replaced file is DATA_LOSS naming the adapter and both hashes, and
   nothing is loaded.

Several processes open the same file. The database runs in WAL mode (readers never
block the writer, nor it them; WAL needs a local filesystem, not NFS) and every
connection waits up to `timeout_s` for a lock instead of failing at once. A `Registry`
serialises its own threads with a lock, so one object can serve a threaded gRPC server.

The schema is versioned by `PRAGMA user_version` and built by `MIGRATIONS`, an
append-only list: opening a file applies the steps it lacks, in one IMMEDIATE
transaction that re-reads the version under the write lock (two processes opening a
fresh file migrate it once). A file written by a newer jlora is refused (SchemaError).
A step, once released, never changes.

Every error is a `RequestError` (`jlora.contract.errors`) whose code is the status the
servers answer with: a RegistryError for the database's own, the contract's for a bad
name or path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeGuard

from jlora.contract.adapters import (
    Adapter,
    check_adapter_name,
    relative_to_adapters_dir,
    resolve_adapter_dir,
)
from jlora.contract.errors import Code, InvalidRequest, RequestError
from jlora.contract.peft import inspect_adapter

MAX_TEXT_LEN = 4096
SHA256_RE = re.compile(r"[0-9a-f]{64}")

# Schema steps, applied in order; step i brings the file to user_version i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE adapters (
            name TEXT PRIMARY KEY NOT NULL,
            base_model TEXT NOT NULL,
            rank INTEGER NOT NULL CHECK (rank > 0),
            alpha REAL NOT NULL CHECK (alpha > 0),  -- lora_alpha
            target_modules TEXT NOT NULL,  -- JSON list, in jlora's canonical order
            path TEXT NOT NULL,            -- relative to the adapters directory
            sha256 TEXT NOT NULL,          -- of adapter_model.safetensors
            size_bytes INTEGER NOT NULL CHECK (size_bytes > 0),
            created_at REAL NOT NULL       -- seconds since the epoch
        )""",
    ),
    # The router lists the adapters of the base model its workers serve.
    ("CREATE INDEX adapters_by_base_model ON adapters (base_model, name)",),
    # The whole record: PEFT's use_rslora (entries of version 2 were registered without
    # it; it then reads false, and the workers read the adapter's own config anyway).
    ("ALTER TABLE adapters ADD COLUMN use_rslora INTEGER NOT NULL DEFAULT 0",),
)
SCHEMA_VERSION = len(MIGRATIONS)
_COLUMNS = (
    "name",
    "base_model",
    "rank",
    "alpha",
    "target_modules",
    "path",
    "sha256",
    "size_bytes",
    "created_at",
    "use_rslora",
)


class RegistryError(RequestError):
    """The registry cannot be used (I/O, a corrupt file)."""

    code = Code.INTERNAL


class RegistryUnavailable(RegistryError):
    """The database stayed locked past the timeout, or its file cannot be opened now."""

    code = Code.UNAVAILABLE


class SchemaError(RegistryError):
    """The file's schema is newer than this jlora, or not a registry at all."""

    code = Code.FAILED_PRECONDITION


class InvalidEntry(RegistryError, InvalidRequest):
    """A bad field of an entry; the message and `field` name it."""

    code = Code.INVALID_ARGUMENT

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.value = value
        super().__init__(f"{field}={value!r}: {reason}", field=field)


class AdapterNotFound(RegistryError):
    """No adapter of that name is registered."""

    code = Code.NOT_FOUND

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"adapter name={name!r} is not registered", field="name", reason="ADAPTER_NOT_FOUND"
        )


class AdapterExists(RegistryError):
    """An adapter of that name is already registered (names are unique)."""

    code = Code.ALREADY_EXISTS

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"name={name!r}: an adapter of that name is already registered "
            "(remove it first to replace it)",
            field="name",
        )


def checked_entry(adapter: Adapter) -> Adapter:
    """`adapter` as the registry stores it, or InvalidEntry naming the bad field.

    The record itself holds a valid rank, alpha and targets. name:
    `jlora.contract.adapters.NAME_RE`. base_model: the base model it adapts (a preset name
    or a model path, as the workers name theirs). size_bytes: > 0. path: the PEFT
    directory, relative to the adapters directory (`resolve_adapter_dir`). sha256: hex
    digest of its adapter_model.safetensors (lowercased). created_at: registration time,
    seconds since the epoch (now, if unset).
    """
    if not isinstance(adapter, Adapter):
        raise InvalidEntry("entry", adapter, "must be an Adapter")
    check_adapter_name(adapter.name)
    _check_text("base_model", adapter.base_model)
    size = adapter.size_bytes
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidEntry("size_bytes", size, "must be a positive integer")
    _check_text("path", adapter.path)
    sha256 = adapter.sha256.lower() if isinstance(adapter.sha256, str) else adapter.sha256
    if not isinstance(sha256, str) or not SHA256_RE.fullmatch(sha256):
        raise InvalidEntry("sha256", adapter.sha256, "must be 64 hexadecimal digits")
    created_at = adapter.created_at or time.time()
    if not _is_finite_number(created_at) or created_at < 0:
        raise InvalidEntry("created_at", adapter.created_at, "must be finite seconds >= 0")
    return dataclasses.replace(adapter, sha256=sha256, created_at=float(created_at))


class Registry:
    """The adapters table of one SQLite file (`":memory:"` for a private, throwaway one).

    Opening creates the file if needed and migrates it to `SCHEMA_VERSION`. Use it as a
    context manager, or call `close()`. Thread-safe; many processes may open one file.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = 10.0) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        try:
            # isolation_level=None: no implicit transactions; each statement commits on
            # its own, and the migration opens its own IMMEDIATE transaction.
            self._conn: sqlite3.Connection | None = sqlite3.connect(
                self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as err:
            raise RegistryUnavailable(f"{self.path}: cannot open the registry ({err})") from err
        try:
            self._enable_wal(timeout_s)
            self._migrate()
        except BaseException:
            self.close()
            raise

    @property
    def schema_version(self) -> int:
        """The file's `PRAGMA user_version` (SCHEMA_VERSION once opened)."""
        return int(self._execute("PRAGMA user_version")[0][0])

    def register(self, adapter: Adapter) -> Adapter:
        """Check and store `adapter` (`checked_entry`), returning the entry as stored;
        InvalidEntry for a bad field, AdapterExists if its name is taken (nothing changes
        then). Its host and device sizes are a worker's, not stored."""
        entry = checked_entry(adapter)
        row = (
            entry.name,
            entry.base_model,
            entry.rank,
            entry.alpha,
            json.dumps(list(entry.targets)),
            entry.path,
            entry.sha256,
            entry.size_bytes,
            entry.created_at,
            int(entry.use_rslora),
        )
        placeholders = ", ".join("?" * len(_COLUMNS))
        try:
            self._execute(
                f"INSERT INTO adapters ({', '.join(_COLUMNS)}) VALUES ({placeholders})", row
            )
        except sqlite3.IntegrityError as err:
            if err.sqlite_errorname == "SQLITE_CONSTRAINT_PRIMARYKEY":
                raise AdapterExists(entry.name) from None
            raise
        return entry

    def get(self, name: str) -> Adapter:
        """The entry named `name`; AdapterNotFound if there is none."""
        rows = self._execute(f"SELECT {', '.join(_COLUMNS)} FROM adapters WHERE name = ?", (name,))
        if not rows:
            raise AdapterNotFound(name)
        return self._entry(rows[0])

    def list(self, base_model: str | None = None) -> tuple[Adapter, ...]:
        """Every entry (of `base_model` only, if given), sorted by name."""
        select = f"SELECT {', '.join(_COLUMNS)} FROM adapters"
        if base_model is None:
            rows = self._execute(f"{select} ORDER BY name")
        else:
            rows = self._execute(f"{select} WHERE base_model = ? ORDER BY name", (base_model,))
        return tuple(self._entry(row) for row in rows)

    def remove(self, name: str) -> None:
        """Delete the entry named `name`; AdapterNotFound if there is none."""
        if not self._execute("DELETE FROM adapters WHERE name = ? RETURNING name", (name,)):
            raise AdapterNotFound(name)

    def close(self) -> None:
        """Close the connection (a second call does nothing)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _entry(self, row: Any) -> Adapter:
        """The entry a row of `_COLUMNS` stores; RegistryError if the row is corrupt."""
        name, base_model, rank, alpha, targets, path, sha256, size_bytes, created_at, rslora = row
        try:
            return checked_entry(
                Adapter(
                    name=name,
                    base_model=base_model,
                    rank=rank,
                    alpha=alpha,
                    targets=tuple(json.loads(targets)),
                    use_rslora=bool(rslora),
                    path=path,
                    sha256=sha256,
                    size_bytes=size_bytes,
                    created_at=created_at,
                )
            )
        except (RequestError, TypeError, ValueError) as err:
            raise RegistryError(
                f"{self.path}: the row of adapter {name!r} is corrupt ({err})"
            ) from err

    def _migrate(self) -> None:
        """Bring the file to SCHEMA_VERSION; the write lock is taken only if needed."""
        if self._checked_version() == SCHEMA_VERSION:
            return
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                version = self._checked_version(conn)  # another process may have migrated
                for step in MIGRATIONS[version:]:
                    for statement in step:
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException as err:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(err, sqlite3.Error):
                    raise _storage_error(self.path, err) from err
                raise

    def _checked_version(self, conn: sqlite3.Connection | None = None) -> int:
        """The file's schema version; SchemaError if this jlora cannot read it."""
        if conn is None:
            version = self.schema_version
        else:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"{self.path}: registry schema version {version} was written by a newer "
                f"jlora; this one reads versions up to {SCHEMA_VERSION} (upgrade jlora)"
            )
        if version < 0:
            raise SchemaError(f"{self.path}: user_version {version} is not a registry version")
        return version

    def _enable_wal(self, timeout_s: float) -> None:
        """Switch the file to write-ahead logging (readers never wait for a writer).

        When several processes open a file that is not in WAL mode yet, SQLite may answer
        one of them SQLITE_BUSY at once, without waiting in its busy handler (seen with
        four processes creating one file on a loaded machine), so the switch is retried
        for up to `timeout_s`, as every other statement waits that long."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self._lock:
                    self._connection().execute("PRAGMA journal_mode = WAL").fetchall()
                return
            except sqlite3.OperationalError as err:
                busy = err.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
                if not busy or time.monotonic() > deadline:
                    raise _storage_error(self.path, err) from err
                time.sleep(0.01)
            except sqlite3.Error as err:
                raise _storage_error(self.path, err) from err

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RegistryError(f"{self.path}: the registry is closed")
        return self._conn

    def _execute(self, sql: str, parameters: Sequence[object] = ()) -> Sequence[Any]:
        """Run one statement (its own transaction) under the object's lock; its rows, all
        fetched before the lock is released (threads share the connection)."""
        with self._lock:
            try:
                return self._connection().execute(sql, parameters).fetchall()
            except sqlite3.IntegrityError:
                raise  # the caller's: `register` turns a taken name into AdapterExists
            except sqlite3.Error as err:
                raise _storage_error(self.path, err) from err


def adapter_from_directory(
    name: str,
    path: str | os.PathLike[str],
    *,
    adapters_dir: str | os.PathLike[str],
    base_model: str,
) -> Adapter:
    """Describe the PEFT adapter at `path` (inside `adapters_dir`) as an entry to register.

    The path is guarded (`resolve_adapter_dir`); rank, alpha, targets, sha256 and size
    come from the directory (`jlora.contract.peft.inspect_adapter`, which checks the
    config and the tensor names; an AdapterError naming "path" if they are wrong). The
    stored path is relative to `adapters_dir`, so the registry survives a different
    mount point on another machine.
    """
    directory = resolve_adapter_dir(path, adapters_dir)
    adapter, _ = inspect_adapter(directory)
    return dataclasses.replace(
        adapter,
        name=name,
        base_model=base_model,
        path=relative_to_adapters_dir(directory, adapters_dir),
    )


def _is_finite_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_text(field: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidEntry(field, value, "must be a non-empty string")
    if len(value) > MAX_TEXT_LEN or not value.isprintable():
        raise InvalidEntry(field, value, f"must be printable and at most {MAX_TEXT_LEN} characters")


def _storage_error(path: str, err: sqlite3.Error) -> RegistryError:
    """The RegistryError for a failed SQLite call: a busy or unopenable file is worth a
    retry (UNAVAILABLE); a file that is not a database is a SchemaError."""
    name = getattr(err, "sqlite_errorname", "")
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN")):
        return RegistryUnavailable(f"{path}: {err}")
    if name.startswith("SQLITE_NOTADB"):
        return SchemaError(f"{path}: not a jlora registry ({err})")
    return RegistryError(f"{path}: {err}")
