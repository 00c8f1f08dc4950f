"""The shared argparse value types of the subcommands."""

from __future__ import annotations

import argparse
import math

import pytest

from kvblocks.cli.arg_types import (
    MAX_THREADS,
    non_negative_int,
    positive_float,
    positive_int,
    thread_count,
    token_ids,
)


def test_ints_accept_their_range_and_name_the_expectation():
    assert positive_int("1") == 1
    assert non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer, got 0"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer >= 0, got -1"):
        non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="got 'x'"):
        positive_int("x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"got '1\.5'"):
        non_negative_int("1.5")


def test_positive_float_allows_inf_but_not_nan_or_zero():
    assert positive_float("0.5") == 0.5
    assert math.isinf(positive_float("inf"))
    for bad in ("nan", "0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a positive number"):
            positive_float(bad)


def test_token_ids_parse_commas_and_reject_negatives_and_empties():
    assert token_ids("1, 2,3") == [1, 2, 3]
    # An empty field is a missing id, not a separator to skip (issue 7, item 19).
    for bad in ("", ",", "1,-2", "a,b", "1,,2", ",1", "1,2,", "1, ,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="token ids such as 1,2,3"):
            token_ids(bad)


def test_thread_count_is_bounded():
    assert thread_count("1") == 1 and thread_count(str(MAX_THREADS)) == MAX_THREADS
    for bad in ("0", str(MAX_THREADS + 1), "100000", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, "):
            thread_count(bad)
