"""Requests: every setting checked up front with a message that names the fix (contract 8)."""

from __future__ import annotations

import math

import pytest

from kvboost_rag.errors import InvalidRequestError
from kvboost_rag.request import SETTINGS, Request

# -- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"max_new_tokens": 0}, "at least one token"),
        ({"max_new_tokens": -5}, "at least one token"),
        ({"max_new_tokens": 2.5}, "at least one token"),
        ({"temperature": -0.1}, "use 0 for greedy"),
        ({"top_p": 0.0}, "use 1.0 to disable"),
        ({"top_p": 1.5}, "use 1.0 to disable"),
        ({"top_p": -0.2}, "use 1.0 to disable"),
        ({"top_k": -1}, "use 0 to disable"),
        ({"stop": ("",)}, "non-empty"),
        ({"stop": ("ok", "")}, "non-empty"),
        ({"stop": ("ok", 3)}, "non-empty strings"),
    ],
)
def test_invalid_params_raise_with_the_fix(kwargs, fix):
    with pytest.raises(InvalidRequestError) as info:
        Request("p", **kwargs)
    message = str(info.value)
    assert fix in message
    name = next(iter(kwargs))
    assert name.rstrip("s") in message  # names the problem too
    assert isinstance(info.value, ValueError)


def test_valid_params_are_accepted():
    p = Request("p", max_new_tokens=1, temperature=0.7, top_p=1.0, top_k=0, seed=3, stop=("x", "END"))
    assert p.stop == ("x", "END")
    Request("p", top_p=1e-9, top_k=1)


def test_nan_temperature_is_rejected():
    with pytest.raises(InvalidRequestError):
        Request("p", temperature=math.nan)


def test_stop_is_stored_as_a_tuple():
    assert Request("p", stop=None).stop == ()
    assert Request("p", stop="END").stop == ("END",)
    assert Request("p", stop=["a", "b"]).stop == ("a", "b")
    assert Request("p", stop=[]).stop == ()


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"seed": 2**64}, "smaller seed"),
        ({"seed": -(2**63) - 1}, "smaller seed"),
        ({"seed": 1.5}, "smaller seed"),
        ({"reuse": "fuzzy"}, "use 'exact', 'blend' or 'off'"),
        ({"blend_recompute_ratio": 1.5}, "such as 0.05"),
    ],
)
def test_seed_and_reuse_settings_are_checked(kwargs, fix):
    with pytest.raises(InvalidRequestError, match=fix):
        Request("p", **kwargs)
    assert Request("p", seed=2**64 - 1).seed == 2**64 - 1


def test_settings_by_name_name_the_unknown_one():
    assert Request.of("p", {"top_k": 5}) == Request("p", top_k=5)
    with pytest.raises(InvalidRequestError, match="unknown setting 'temprature'; known: max_new_tokens"):
        Request.of("p", {"temprature": 0.5})
    assert SETTINGS[0] == "max_new_tokens" and "prompt" not in SETTINGS and len(SETTINGS) == 11


def test_with_settings_changes_and_checks_again():
    base = Request("p", temperature=0.5, stop="x")
    changed = base.with_settings(top_k=3)
    assert (changed.prompt, changed.temperature, changed.top_k, changed.stop) == ("p", 0.5, 3, ("x",))
    with pytest.raises(InvalidRequestError, match="top_k"):
        base.with_settings(top_k=-1)
    with pytest.raises(InvalidRequestError, match="unknown setting"):
        base.with_settings(topk=1)


def test_cache_salt_must_be_a_non_empty_string():
    assert Request("p", cache_salt="tenant-a").cache_salt == "tenant-a"
    for bad in ("", 7):
        with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
            Request("p", cache_salt=bad)
