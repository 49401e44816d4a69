"""Namespaces separate everything that changes a page's bytes; keys cannot be paths; the
one-pass common-batch check (hicache_l3._keys.common_batch) answers as the connector's
key-by-key checks."""

from __future__ import annotations

import dataclasses
import itertools
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.common.errors import ConfigError, InvalidKeyError
from hicache_l3.common.keys import (
    KEY_FORMAT_VERSION,
    Namespace,
    all_valid_keys,
    is_valid_key,
    validate_key,
)
from hicache_l3.common.pages import common_batch
from tests.reference.pages import plain_segments

BASE = Namespace(model="org/model", kv_dtype="bfloat16", layout="page_first", page_size=64)


@pytest.mark.parametrize(
    "change",
    [{"model": "org/other"}, {"kv_dtype": "float8_e4m3fn"}, {"layout": "layer_first"},
     {"page_size": 32}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"pp_rank": 1, "pp_size": 2},
     {"cp_rank": 1, "cp_size": 2}, {"dcp_rank": 1, "dcp_size": 2}, {"tag": "x"},
     {"version": KEY_FORMAT_VERSION + 1}],
)
def test_every_field_changes_the_digest(change):
    assert dataclasses.replace(BASE, **change).digest() != BASE.digest()


def test_mla_shared_drops_tp_rank():
    a = dataclasses.replace(BASE, mla_shared=True, tp_rank=0, tp_size=4)
    b = dataclasses.replace(BASE, mla_shared=True, tp_rank=3, tp_size=4)
    assert a.digest() == b.digest()
    assert dataclasses.replace(BASE, tp_rank=0, tp_size=4).digest() != a.digest()


def test_storage_key_is_prefixed():
    assert BASE.storage_key("abc") == f"{BASE.digest()}:abc"


@pytest.mark.parametrize("kw", [{"tp_rank": 2, "tp_size": 2}, {"page_size": 0}, {"model": ""},
                                {"pp_rank": -1}])
def test_bad_namespace_is_refused(kw):
    with pytest.raises(ConfigError):
        dataclasses.replace(BASE, **kw)


def test_from_dict_names_unknown_fields():
    with pytest.raises(ConfigError, match="dp_rank"):
        Namespace.from_dict({**dataclasses.asdict(BASE), "dp_rank": 1})


@pytest.mark.parametrize("key", ["a" * 64, "0f3c_part:k=1", "hash@v2", "A.B-C+D"])
def test_valid_keys(key):
    assert is_valid_key(key) and validate_key(key) == key


@pytest.mark.parametrize("key", ["", "../x", "a/b", "/abs", "a\0b", ".hidden", "-flag", "a b",
                                 "x" * 257, "é", None, 5])
def test_invalid_keys(key):
    assert not is_valid_key(key)
    with pytest.raises(InvalidKeyError):
        validate_key(key)


def test_batch_check_agrees_with_per_key_check():
    from hicache_l3.common.keys import all_valid_keys

    good = ["a" * 64, "0f3c_part:k=1", "hash@v2", "A.B-C+D"]
    assert all_valid_keys(good) and all_valid_keys([])
    for bad in ["", "../x", "a/b", ".hidden", "-flag", "a b", "x" * 257, "é", None, 5, "a\0b"]:
        assert not all_valid_keys([*good, bad]), bad
        assert not all_valid_keys([bad]), bad


_KEY_CHARS = "aZ09_.:=+@-/ \0é"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet=_KEY_CHARS, max_size=6),
                          st.sampled_from(["a" * 256, "b" * 257, "0f" * 32, ".x", "-x", ""]),
                          st.integers(), st.none()), max_size=6))
def test_batch_check_equals_per_key_check(keys):
    """The batch check is exact (not merely safe): True exactly when every key is valid,
    so the per-key fallback runs only for batches that hold a bad key."""
    from hicache_l3.common.keys import all_valid_keys

    assert all_valid_keys(keys) == all(map(is_valid_key, keys))


class _Key(str):
    """A str subclass: valid like any str (is_valid_key takes isinstance)."""


_BATCH_KEYS = st.lists(st.one_of(st.text(alphabet=_KEY_CHARS, max_size=40),
                                 st.sampled_from(["a" * 256, "b" * 257, "0f" * 32, ".x", "-x", "",
                                                  "0f" * 31 + "é", "0f" * 20 + ".", _Key("ab")]),
                                 st.integers(), st.none()), max_size=6)


@settings(max_examples=400, deadline=None)
@given(_BATCH_KEYS)
def test_native_and_python_key_checks_agree_with_per_key_check(keys):
    """The C pass (hicache_l3._keys) and the Python reference answer exactly as
    is_valid_key per key; the prefixed list is prefix + key, per key, in order."""
    from hicache_l3 import _keys
    from tests.reference import keys as ref

    expect = all(map(is_valid_key, keys))
    prefix = BASE.storage_key("")
    want = [prefix + k for k in keys] if expect else None
    assert _keys.valid_keys(keys) == ref.all_valid_keys(keys) == expect
    assert _keys.prefixed_keys(prefix, keys) == ref.prefixed_valid_keys(prefix, keys) == want
    assert _keys.prefixed_keys(prefix, tuple(keys)) == want


def test_native_prefixed_keys_of_long_and_punctuated_keys():
    """Keys longer than the 16-byte SIMD step, with punctuation or a bad byte at any
    offset: the table decides past the first non-alphanumeric block."""
    from hicache_l3 import _keys

    for n in (1, 15, 16, 17, 31, 32, 64, 255, 256):
        key = ("0123456789abcdefABCDEFxyz" * 11)[:n]
        assert _keys.prefixed_keys("p:", [key]) == ["p:" + key]
        for at in range(1, n):
            for ch, ok in (("_", True), (":", True), ("-", True), ("/", False), ("\x7f", False),
                           (" ", False), ("\0", False), ("`", False), ("[", False), ("{", False)):
                bad = key[:at] + ch + key[at + 1:]
                assert _keys.valid_keys([bad]) is ok == is_valid_key(bad), (n, at, ch)
    assert _keys.prefixed_keys("p:", ["a" * 257]) is None
    with pytest.raises(TypeError):
        _keys.prefixed_keys("é:", ["a"])
    with pytest.raises(TypeError):
        _keys.valid_keys(5)


@pytest.mark.parametrize(("extension", "module"), [("_keys", "hicache_l3.common.keys"),
                                                   ("_host_pages", "hicache_l3.sglang.page_meta")])
def test_a_missing_extension_is_an_import_error_naming_the_fix(extension: str, module: str) -> None:
    """The C extensions are required: without one, the module using it does not import,
    and the error says how to get it (no silent Python path)."""
    import subprocess
    import sys

    code = (f"import importlib, sys; sys.modules['hicache_l3.{extension}'] = None\n"
            "try:\n"
            f"    importlib.import_module('{module}')\n"
            "except ImportError as exc:\n"
            f"    assert 'hicache_l3.{extension}' in str(exc) and 'C compiler' in str(exc), exc\n"
            "else:\n"
            f"    raise SystemExit('{module} imported without hicache_l3.{extension}')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- the one-pass common-batch check ------------------------------------------------------

def _reference_common(keys: list[Any], pages: list[Any]) -> tuple[bytes, int, int, int, int, bool] | None:
    """What common_batch must answer, from the Python checks (plain_segments and the
    connector's rules)."""
    if not pages or len(keys) != len(pages) or type(keys) not in (list, tuple) \
            or type(pages) not in (list, tuple) or not all_valid_keys(keys):
        return None
    plain = plain_segments(pages)
    if plain is None or len(set(map(len, pages))) != 1:
        return None
    addresses, lengths = plain
    size = lengths[0]
    if size <= 0 or set(lengths) != {size} or min(addresses) < 0 or max(addresses) + size >= 1 << 64:
        return None
    ordered = sorted(addresses)
    overlap = any(b - a < size for a, b in itertools.pairwise(ordered))
    flat = struct.pack(f"={2 * len(addresses)}Q", *[v for pair in zip(addresses, lengths) for v in pair])
    return flat, len(pages[0]), size, min(addresses), max(addresses) + size, overlap


_segment = st.one_of(
    st.tuples(st.integers(0, 1 << 20).map(lambda a: a * 64), st.sampled_from([64, 64, 64, 128])),
    st.tuples(st.integers(-5, 5), st.just(64)),
    st.just((1.0, 64)), st.just((64, 64, 64)), st.just([128, 64]), st.just((True, 64)),
    st.just((1 << 64, 64)),
)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3).flatmap(lambda k: st.lists(
    st.lists(_segment, min_size=k, max_size=k).map(tuple), min_size=0, max_size=6)),
    st.lists(st.sampled_from(["k1", "k2", "a:b", ".bad", "", "x" * 300]), min_size=0, max_size=6))
def test_common_batch_agrees_with_the_python_checks(pages: list[Any], keys: list[str]) -> None:
    assert common_batch is not None, "hicache_l3._keys not built (common_batch missing)"
    keys = (keys + ["k"] * len(pages))[: len(pages)] if keys or pages else keys
    assert common_batch is not None
    assert common_batch(keys, pages) == _reference_common(keys, pages)


def test_common_batch_sees_overlap_and_order() -> None:
    assert common_batch is not None
    keys = ["a", "b", "c"]
    assert common_batch(keys, [((0, 64),), ((64, 64),), ((128, 64),)])[5] is False  # type: ignore[index]
    assert common_batch(keys, [((128, 64),), ((0, 64),), ((64, 64),)])[5] is False  # type: ignore[index]
    assert common_batch(keys, [((128, 64),), ((0, 64),), ((127, 64),)])[5] is True  # type: ignore[index]
    assert common_batch(keys, [((64, 64),), ((0, 64),), ((64, 64),)])[5] is True  # type: ignore[index]
    assert common_batch(keys, [((0, 64),), ((64, 64),)]) is None  # fewer pages than keys
