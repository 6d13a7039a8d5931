"""The global adapter registry (`jlora.contract.registry`) on real SQLite files.

Entries round-trip and survive reopening; every bad field is refused with an
InvalidRequest naming it, and nothing is stored; an older file is migrated on open, a
newer one refused untouched; connections in one process and in several processes see
each other's writes (and two racing registrations of one name give one winner); an
entry describes a real PEFT directory inside the adapters directory. (The path guard
and the sha256 check are the contract's: tests/test_contract.py.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from configs import load_preset
from jlora.adapters.peft import make_demo_adapters
from jlora.contract.adapters import WEIGHTS_FILE, Adapter, resolve_adapter_dir
from jlora.contract.errors import Code, InvalidRequest
from jlora.contract.registry import (
    SCHEMA_VERSION,
    AdapterExists,
    AdapterNotFound,
    InvalidEntry,
    Registry,
    RegistryError,
    RegistryUnavailable,
    SchemaError,
    adapter_from_directory,
)

ROOT = Path(__file__).resolve().parent.parent
SHA = "ab" * 32

# Schema version 1 as released: a frozen copy, so that a change to MIGRATIONS[0] (which
# must never change once released) fails test_migrates_a_version_1_file.
V1_SCHEMA = """CREATE TABLE adapters (
    name TEXT PRIMARY KEY NOT NULL,
    base_model TEXT NOT NULL,
    rank INTEGER NOT NULL CHECK (rank > 0),
    alpha REAL NOT NULL CHECK (alpha > 0),
    target_modules TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL CHECK (size_bytes > 0),
    created_at REAL NOT NULL
)"""


def _entry(name: str = "sql-lora", **changes) -> Adapter:
    fields = dict(
        name=name,
        base_model="smollm2-135m",
        rank=16,
        alpha=32.0,
        targets=("q_proj", "v_proj"),
        path=f"{name}-dir",
        sha256=SHA,
        size_bytes=1234,
        created_at=1_700_000_000.5,
    )
    return Adapter(**{**fields, **changes})


@pytest.fixture
def registry(tmp_path):
    with Registry(tmp_path / "registry.db") as opened:
        yield opened


# -- entries and the table ------------------------------------------------------------


def test_round_trip_list_remove_and_reopen(tmp_path):
    file = tmp_path / "registry.db"
    entries = [
        _entry("b-lora", rank=64, targets=("down_proj", "self_attn.q_proj")),
        _entry("a-lora"),
        _entry("org/c-lora", base_model="llama2-7b"),
    ]
    with Registry(file) as registry:
        assert registry.schema_version == SCHEMA_VERSION
        stored = [registry.register(entry) for entry in entries]
        got = registry.get("b-lora")
        assert got == stored[0]
        assert got.targets == ("q_proj", "down_proj")  # canonical order
        assert stored[1:] == entries[1:]  # already canonical: stored as given
        assert [e.name for e in registry.list()] == ["a-lora", "b-lora", "org/c-lora"]
        assert [e.name for e in registry.list("smollm2-135m")] == ["a-lora", "b-lora"]
        assert registry.list("no-such-model") == ()
        registry.remove("a-lora")
        with pytest.raises(AdapterNotFound, match="'a-lora' is not registered"):
            registry.get("a-lora")
    with Registry(file) as reopened:
        assert reopened.list() == (stored[0], stored[2])
        assert reopened.get("org/c-lora").created_at == 1_700_000_000.5


def test_the_whole_record_round_trips(registry):
    """Every field of the record but the worker's sizes: rsLoRA included."""
    entry = _entry("rs", use_rslora=True, alpha=8.0, rank=4)
    assert registry.register(entry) == registry.get("rs") == entry
    assert registry.get("rs").scaling == 4.0  # 8 / sqrt(4)


def test_in_memory_registry():
    with Registry(":memory:") as registry:
        assert registry.schema_version == SCHEMA_VERSION
        registry.register(_entry())
        assert registry.list() == (_entry(),)


def test_unknown_names_are_not_found(registry):
    for call in (registry.get, registry.remove):
        with pytest.raises(AdapterNotFound) as err:
            call("ghost")
        assert err.value.name == "ghost" and "'ghost'" in str(err.value)
        assert (err.value.code, err.value.field) == (Code.NOT_FOUND, "name")


def test_duplicate_name_is_refused_and_the_first_kept(registry):
    first = registry.register(_entry("dup", rank=8))
    with pytest.raises(AdapterExists, match=r"name='dup'.*already registered") as err:
        registry.register(_entry("dup", rank=32))
    assert err.value.name == "dup"
    assert registry.get("dup") == first
    assert len(registry.list()) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", ""),
        ("name", "../etc"),
        ("name", "has space"),
        ("name", "a//b"),
        ("name", "trailing/"),
        ("name", "a:b:c"),
        ("name", "x" * 129),
        ("name", 7),
        ("base_model", ""),
        ("base_model", "tab\tin"),
        ("rank", 0),
        ("rank", -8),
        ("rank", True),
        ("rank", 16.0),
        ("alpha", 0),
        ("alpha", math.inf),
        ("targets", ()),
        ("targets", ("lm_head",)),
        ("targets", "q_proj"),
        ("use_rslora", 1),
        ("path", ""),
        ("path", "nul\x00byte"),
        ("sha256", "abc"),
        ("sha256", "g" * 64),
        ("sha256", None),
        ("size_bytes", 0),
        ("created_at", float("nan")),
        ("created_at", -1.0),
    ],
)
def test_bad_fields_are_named_and_nothing_is_stored(registry, field, value):
    """The record refuses what no adapter can be (a rank of 0); the registry what it
    cannot store (a name outside the rule, a hash that is not one): both name the field."""
    with pytest.raises(InvalidRequest) as err:
        registry.register(_entry(**{"name": "ok"} | {field: value}))
    assert err.value.field == field
    assert err.value.message.startswith(f"{field}") and err.value.code == Code.INVALID_ARGUMENT
    assert registry.list() == ()


def test_register_refuses_a_non_entry(registry):
    with pytest.raises(InvalidEntry, match="entry="):
        registry.register(dataclasses.asdict(_entry()))  # type: ignore[arg-type]


def test_sha256_is_stored_lowercase(registry):
    registry.register(_entry("upper", sha256="AB" * 32))
    assert registry.get("upper").sha256 == SHA


def test_exceptions_carry_their_status_and_field():
    assert (AdapterNotFound("x").code, AdapterNotFound("x").field) == (Code.NOT_FOUND, "name")
    assert (AdapterExists("x").code, AdapterExists("x").field) == (Code.ALREADY_EXISTS, "name")
    assert InvalidEntry("rank", 0, "bad").code == Code.INVALID_ARGUMENT
    assert SchemaError("x").code == Code.FAILED_PRECONDITION
    assert RegistryUnavailable("x").code == Code.UNAVAILABLE
    assert RegistryError("x").code == Code.INTERNAL


def test_closed_registry_says_so(tmp_path):
    registry = Registry(tmp_path / "r.db")
    registry.close()
    registry.close()  # a second close does nothing
    with pytest.raises(RegistryError, match="closed"):
        registry.list()


# -- schema and migrations ------------------------------------------------------------


def _objects(file: Path) -> set[tuple[str, str]]:
    with sqlite3.connect(file) as conn:
        return set(conn.execute("SELECT type, name FROM sqlite_master WHERE sql IS NOT NULL"))


def _user_version(file: Path) -> int:
    with sqlite3.connect(file) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


def test_new_file_gets_the_latest_schema_in_wal_mode(tmp_path):
    file = tmp_path / "fresh.db"
    Registry(file).close()
    assert _user_version(file) == SCHEMA_VERSION == 3
    assert ("index", "adapters_by_base_model") in _objects(file)
    with sqlite3.connect(file) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrates_a_version_1_file(tmp_path):
    file = tmp_path / "v1.db"
    conn = sqlite3.connect(file)
    conn.execute(V1_SCHEMA)
    conn.execute(
        "INSERT INTO adapters VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("old", "smollm2-135m", 8, 32.0, '["q_proj"]', "old-dir", SHA, 99, 1.0),
    )
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    assert ("index", "adapters_by_base_model") not in _objects(file)

    with Registry(file) as registry:
        assert registry.schema_version == SCHEMA_VERSION
        assert registry.get("old") == _entry(
            "old", rank=8, targets=("q_proj",), path="old-dir", size_bytes=99, created_at=1.0
        )  # use_rslora, a column of version 3, reads false
        registry.register(_entry("new"))
    assert ("index", "adapters_by_base_model") in _objects(file)
    assert _user_version(file) == SCHEMA_VERSION


def test_newer_schema_is_refused_untouched(tmp_path):
    file = tmp_path / "future.db"
    Registry(file).close()
    with sqlite3.connect(file) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(SchemaError, match=rf"version {SCHEMA_VERSION + 1}.*newer jlora"):
        Registry(file)
    assert _user_version(file) == SCHEMA_VERSION + 1


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    file = tmp_path / "notes.db"
    file.write_bytes(b"this is not sqlite, just some text that is long enough" * 40)
    with pytest.raises(SchemaError, match="not a jlora registry"):
        Registry(file)


def test_missing_directory_is_unavailable(tmp_path):
    with pytest.raises(RegistryUnavailable, match="no-such-dir"):
        Registry(tmp_path / "no-such-dir" / "r.db")


# -- sharing one file -----------------------------------------------------------------


def test_two_connections_see_each_others_writes(tmp_path):
    file = tmp_path / "shared.db"
    with Registry(file) as router, Registry(file) as worker:
        router.register(_entry("from-router"))
        assert worker.get("from-router") == router.get("from-router")
        worker.remove("from-router")
        with pytest.raises(AdapterNotFound):
            router.get("from-router")
        with pytest.raises(AdapterExists):
            worker.register(_entry("twice"))
            router.register(_entry("twice"))


def test_threads_share_one_registry(registry):
    """A threaded server shares one Registry (so it must not be bound to the thread that
    opened it): concurrent writes and reads from eight threads all land."""

    def work(thread: int) -> list[str]:
        names = []
        for i in range(25):
            entry = registry.register(_entry(f"t{thread}-{i}"))
            names.append(registry.get(entry.name).name)
            registry.list()
        return names

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(work, range(8)))
    assert results == [[f"t{t}-{i}" for i in range(25)] for t in range(8)]
    assert len(registry.list()) == 200


_WRITER = textwrap.dedent(
    """
    import sys
    from jlora.contract.adapters import Adapter
    from jlora.contract.registry import AdapterExists, Registry

    file, tag = sys.argv[1], sys.argv[2]
    with Registry(file) as registry:
        for i in range(20):
            registry.register(Adapter(
                name=f"{tag}-{i}", base_model="m", rank=8, alpha=16, targets=("q_proj",),
                path=f"{tag}-{i}", sha256="ab" * 32, size_bytes=1,
            ))
            assert registry.get(f"{tag}-{i}").name == f"{tag}-{i}"
        try:
            registry.register(Adapter(
                name="contested", base_model="m", rank=8, alpha=16, targets=("q_proj",),
                path=tag, sha256="ab" * 32, size_bytes=1,
            ))
            print("won")
        except AdapterExists:
            print("lost")
    """
)


def test_processes_share_one_fresh_file(tmp_path):
    """Four processes open a file that does not exist yet (so they race to create and
    migrate it) and register concurrently; every entry lands, one wins the contested name."""
    file = tmp_path / "multi.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(file), f"p{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    outcomes = []
    for writer in writers:
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        outcomes.append(out.strip())
    assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
    with Registry(file) as registry:
        names = {entry.name for entry in registry.list()}
        assert names == {f"p{p}-{i}" for p in range(4) for i in range(20)} | {"contested"}
        winner = outcomes.index("won")
        assert registry.get("contested").path == f"p{winner}"


# -- describing adapters ---------------------------------------------------------------


@pytest.fixture
def demo_adapter(tmp_path):
    """A real PEFT directory (cpu-tiny shapes, rank 4) inside tmp_path/adapters."""
    root = tmp_path / "adapters"
    (path,) = make_demo_adapters(
        load_preset("cpu-tiny").config, root / "team", n=1, ranks=[4], targets=["q_proj", "o_proj"]
    )
    return root, path


def test_adapter_from_directory_reads_rank_targets_and_hash(demo_adapter, registry):
    root, path = demo_adapter
    entry = adapter_from_directory("team/tiny", path, adapters_dir=root, base_model="cpu-tiny")
    weights = (path / WEIGHTS_FILE).read_bytes()
    assert (entry.rank, entry.alpha) == (4, 8.0)  # demo adapters have alpha = 2 * rank
    assert entry.targets == ("q_proj", "o_proj")
    assert entry.sha256 == hashlib.sha256(weights).hexdigest()
    assert entry.size_bytes == len(weights)
    assert entry.path == "team/demo-00-r4"  # relative to the adapters directory
    registry.register(entry)
    stored = registry.get("team/tiny")
    assert resolve_adapter_dir(stored.path, root) == path.resolve()


def test_adapter_from_directory_refuses_a_non_adapter(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    with pytest.raises(InvalidRequest, match="adapter_config.json|peft_type") as err:
        adapter_from_directory("x", "a", adapters_dir=tmp_path, base_model="m")
    assert err.value.field == "path"
