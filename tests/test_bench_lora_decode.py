"""bench.lora_decode's systems: the reference backend once per decode form and pool
asked for, MBGMV once per pool, each once per slot targets."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from bench import lora_decode
from bench.lib.engines import Plan, System, lora_targets
from configs.engine import LORA_TARGETS


def test_the_reference_backend_runs_once_per_form_and_pool_mbgmv_per_pool_bgmv_once():
    plan = Plan(
        backends=("reference", "mbgmv", "bgmv"),
        reference_forms=("auto", "over-slots"),
        lora_pools=("kv", "slots"),
    )
    assert lora_decode._systems(plan) == [
        System("reference", "reference", "auto", "kv"),
        System("reference[slots]", "reference", "auto", "slots"),
        System("reference[over-slots]", "reference", "over-slots", "kv"),
        System("reference[over-slots,slots]", "reference", "over-slots", "slots"),
        System("mbgmv", "mbgmv", "auto", "kv"),
        System("mbgmv[slots]", "mbgmv", "auto", "slots"),
        System("bgmv", "bgmv", "auto", "kv"),
    ]


def test_each_engine_runs_once_per_slot_targets_and_all_seven_is_tagged():
    plan = Plan(backends=("reference", "bgmv"), slot_targets=("adapters", "all"))
    assert lora_decode._systems(plan) == [
        System("reference", "reference"),
        System("reference[all-targets]", "reference", slot_targets="all"),
        System("bgmv", "bgmv"),
        System("bgmv[all-targets]", "bgmv", slot_targets="all"),
    ]


def test_slots_cover_the_adapters_targets_unless_all_are_asked_for():
    plan = Plan(targets=("q_proj", "v_proj"))
    assert lora_targets(plan, "adapters") == ("q_proj", "v_proj")
    assert lora_targets(plan, "all") == LORA_TARGETS == Plan().targets


def test_unknown_slot_targets_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        lora_decode.main(["--slot-targets", "some"])
    assert "--slot-targets" in capsys.readouterr().err


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


def test_the_benches_of_jlora_against_itself_need_no_torch():
    """bench.lib.timing holds what they share with bench.throughput, which imports torch:
    these benches run where only jlora's own dependencies are installed."""
    modules = ["bench.lora_decode", "bench.prefill", "bench.step_profile", "bench.sharding"]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
