"""bench.lora_decode's systems: the reference backend once per decode form and pool
asked for, MBGMV once per pool."""

from __future__ import annotations

import argparse

import pytest

from bench import lora_decode
from bench.lora_decode import Plan


def test_the_reference_backend_runs_once_per_form_and_pool_mbgmv_per_pool_bgmv_once():
    plan = Plan(
        backends=("reference", "mbgmv", "bgmv"),
        reference_forms=("auto", "over-slots"),
        lora_pools=("kv", "slots"),
    )
    assert lora_decode._systems(plan) == [
        ("reference", "reference", "auto", "kv"),
        ("reference[slots]", "reference", "auto", "slots"),
        ("reference[over-slots]", "reference", "over-slots", "kv"),
        ("reference[over-slots,slots]", "reference", "over-slots", "slots"),
        ("mbgmv", "mbgmv", "auto", "kv"),
        ("mbgmv[slots]", "mbgmv", "auto", "slots"),
        ("bgmv", "bgmv", "auto", "kv"),
    ]


def test_an_unknown_form_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        lora_decode.main(["--reference-forms", "auto,dense"])
    err = capsys.readouterr().err
    assert "--reference-forms" in err and "['dense'] not in ['auto', 'gather', 'over-slots']" in err


def test_repeats_below_one_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        lora_decode.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_names_from_keeps_the_order_given_and_lists_the_choices_when_one_is_unknown():
    from jlora.cli.common import names_from

    parse = names_from(("a", "b", "c"))
    assert parse("c,a") == ("c", "a")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\['x', 'y'\] not in \['a', 'b', 'c'\]"):
        parse("y,a,x")
