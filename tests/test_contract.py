"""The contract the router and the workers share (`jlora.contract`): the adapter name
rule, the path guard, the content hash, the error as a gRPC status and back, the API key.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from jlora.contract import status
from jlora.contract.adapters import (
    MAX_NAME_LEN,
    WEIGHTS_FILE,
    check_adapter_name,
    check_sha256,
    resolve_adapter_dir,
    sha256_of,
)
from jlora.contract.auth import authorized, call_metadata, resolve_api_key
from jlora.contract.errors import Code, FailedPrecondition, InvalidRequest, NotFound, RequestError
from jlora.contract.signals import WAKE_S, wait_awake

# -- names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["sql-lora", "a", "org/c-lora:v2", "org/team/x.y_z", "Llama-2-7b-chat-lora:2024.01", "x" * 128],
)
def test_names_users_give_adapters_are_accepted(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../etc",
        "org/../x",
        "/abs",
        "trailing/",
        "a//b",
        "has space",
        "a:b:c",
        "tag:",
        ":tag",
        "-leading",
        "x" * 129,
        "new\nline",
        7,
    ],
)
def test_other_names_are_refused_naming_the_field(name):
    with pytest.raises(InvalidRequest) as caught:
        check_adapter_name(name, field="lora_name")
    assert caught.value.field == "lora_name" and "lora_name" in caught.value.message


def test_the_base_models_id_is_not_an_adapter_name():
    with pytest.raises(InvalidRequest, match="base model"):
        check_adapter_name("smollm2-135m", base_model="smollm2-135m")
    assert MAX_NAME_LEN == 128


# -- the path guard -----------------------------------------------------------------


@pytest.fixture
def adapters_dir(tmp_path):
    """adapters/{a,b} inside, outside/{evil,secret} next to it."""
    root = tmp_path / "adapters"
    for directory in (root / "a", root / "b", tmp_path / "outside" / "evil"):
        directory.mkdir(parents=True)
        (directory / "adapter_config.json").write_text("{}")
    (tmp_path / "outside" / "secret").write_bytes(b"not yours")
    (root / "a.txt").write_text("a file")
    return root


def test_paths_inside_are_accepted(adapters_dir):
    real = adapters_dir.resolve()
    assert resolve_adapter_dir("a", adapters_dir) == real / "a"
    assert resolve_adapter_dir(str(real / "b"), adapters_dir) == real / "b"  # absolute, inside
    (adapters_dir / "alias").symlink_to(adapters_dir / "a")  # a link that stays inside
    assert resolve_adapter_dir("alias", adapters_dir) == real / "a"


@pytest.mark.parametrize(
    "path, reason",
    [
        ("", "empty"),
        ("../outside/evil", "'..'"),
        ("a/../b", "'..'"),
        ("missing", "does not exist"),
        (".", "outside the adapters directory"),
        ("a.txt", "is not a directory"),
        ("{outside}/evil", "outside the adapters directory"),  # absolute, outside
    ],
)
def test_escapes_and_non_directories_are_refused(adapters_dir, path, reason):
    path = path.format(outside=adapters_dir.parent / "outside")
    with pytest.raises(InvalidRequest, match=reason) as caught:
        resolve_adapter_dir(path, adapters_dir)
    assert caught.value.field == "path"


def test_symlinks_out_are_refused(adapters_dir):
    outside = adapters_dir.parent / "outside"
    (adapters_dir / "link").symlink_to(outside / "evil")
    with pytest.raises(InvalidRequest, match="outside the adapters directory"):
        resolve_adapter_dir("link", adapters_dir)
    (adapters_dir / "a" / WEIGHTS_FILE).symlink_to(outside / "secret")
    with pytest.raises(InvalidRequest, match=f"{WEIGHTS_FILE} linking to .*outside"):
        resolve_adapter_dir("a", adapters_dir)


def test_a_server_without_an_adapters_dir_takes_paths_as_given(adapters_dir):
    assert resolve_adapter_dir(adapters_dir / "a", None) == (adapters_dir / "a").resolve()
    with pytest.raises(InvalidRequest, match="does not exist"):
        resolve_adapter_dir(adapters_dir / "missing", None)


def test_an_unusable_adapters_dir_is_the_servers_fault(tmp_path):
    with pytest.raises(FailedPrecondition, match="adapters directory"):
        resolve_adapter_dir("a", tmp_path / "nowhere")


# -- content ------------------------------------------------------------------------


def test_a_hash_mismatch_is_data_loss_naming_both_hashes(tmp_path):
    weights = tmp_path / WEIGHTS_FILE
    weights.write_bytes(b"x" * 3_000_000)  # more than one read chunk
    actual = sha256_of(weights)
    assert actual == hashlib.sha256(weights.read_bytes()).hexdigest()
    check_sha256(actual.upper(), actual, adapter="a", source=weights)  # case does not matter
    check_sha256(None, actual, adapter="a", source=weights)  # nothing expected
    expected = "0" * 64
    with pytest.raises(RequestError) as caught:
        check_sha256(expected, actual, adapter="tiny", source=weights)
    error = caught.value
    assert (error.code, error.field, error.reason) == (
        Code.DATA_LOSS,
        "sha256",
        "CHECKSUM_MISMATCH",
    )
    assert "'tiny'" in error.message and expected in error.message and actual in error.message


# -- errors on the wire -------------------------------------------------------------


class _Failed(grpc.RpcError):
    """A failed call as a client sees it."""

    def __init__(self, code, details, metadata):
        self._code, self._details, self._metadata = code, details, metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


def test_an_error_crosses_the_wire_with_its_field_and_reason():
    error = NotFound("adapter='x' is not registered", field="adapter", reason="ADAPTER_NOT_FOUND")
    [(key, raw)] = status.trailing_metadata(error)
    decoded = status_pb2.Status.FromString(raw)  # what any gRPC client library reads
    assert key == "grpc-status-details-bin"
    assert (decoded.code, decoded.message) == (grpc.StatusCode.NOT_FOUND.value[0], error.message)
    bad, info = error_details_pb2.BadRequest(), error_details_pb2.ErrorInfo()
    assert decoded.details[0].Unpack(bad) and decoded.details[1].Unpack(info)
    assert bad.field_violations[0].field == "adapter"
    assert (info.reason, info.domain) == ("ADAPTER_NOT_FOUND", "jlora.v1")
    back = status.from_rpc_error(
        _Failed(grpc.StatusCode.NOT_FOUND, error.message, [("other", "x"), (key, raw)])
    )
    assert (back.code, back.field, back.reason, back.message) == (
        Code.NOT_FOUND,
        "adapter",
        "ADAPTER_NOT_FOUND",
        error.message,
    )


def test_a_plain_status_still_becomes_an_error():
    back = status.from_rpc_error(_Failed(grpc.StatusCode.UNAVAILABLE, "gone", None))
    assert (back.code, back.field, back.reason, back.message) == (
        Code.UNAVAILABLE,
        None,
        "UNAVAILABLE",
        "gone",
    )
    without_field = status.status_proto(RequestError("broken"))
    assert len(without_field.details) == 1  # ErrorInfo only: no field is at fault


# -- the API key ----------------------------------------------------------------------


def test_the_api_key_is_checked_in_constant_time_and_optional(monkeypatch):
    assert authorized(None, None) and authorized("anything", None)
    assert authorized("Bearer s3cret", "s3cret") and authorized("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer wrong", "Basic s3cret"):
        assert not authorized(header, "s3cret")
    assert call_metadata("k") == (("authorization", "Bearer k"),) and call_metadata(None) == ()
    monkeypatch.setenv("JLORA_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("given") == "given"
    monkeypatch.setenv("JLORA_API_KEY", "")
    assert resolve_api_key(None) is None


# -- signals ----------------------------------------------------------------------------


def test_a_signal_another_thread_catches_is_handled_while_the_main_thread_waits():
    """A drain's handler runs on the main thread; a plain `Event.wait` there sleeps
    through a signal the kernel handed to another thread (the router's and the worker's
    `wait()` did: a likely cause of the one time-out of the SIGTERM drain test). `wait_awake`
    does not."""
    stopped = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: stopped.set())
    other = threading.Thread(target=time.sleep, args=(1.0,))
    other.start()
    try:
        threading.Timer(0.05, signal.pthread_kill, (other.ident, signal.SIGUSR1)).start()
        start = time.monotonic()
        assert wait_awake(stopped, timeout=10.0)
        assert time.monotonic() - start < 2 * WAKE_S + 0.5
        assert not wait_awake(threading.Event(), timeout=0.1)
    finally:
        other.join()
        signal.signal(signal.SIGUSR1, previous)
