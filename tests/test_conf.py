"""Settings: parsed once, validated, unknown keys refused with a suggestion (no Spark)."""

from __future__ import annotations

import pytest

from spark_state.conf import KNOWN_KEYS, StateConf
from spark_state.errors import ConfigError

DEFAULTS = {"default_store": "/state", "default_parallelism": 2}


def test_defaults_and_values():
    conf = StateConf.from_mapping({"spark.state.parallelism": " 5 ", "spark.state.compression": "ZSTD"}, **DEFAULTS)
    assert (conf.store, conf.parallelism, conf.max_parallelism, conf.compression) == ("/state", 5, 4096, "zstd")
    lazy = StateConf.parse({}.get, default_store=lambda: "/lazy", default_parallelism=3)
    assert (lazy.store, lazy.parallelism) == ("/lazy", 3)


@pytest.mark.parametrize("key, suggestion", [
    ("spark.state.paralelism", "spark.state.parallelism"),
    ("spark.state.maxparallelism", "spark.state.maxParallelism"),
    ("spark.state.stor", "spark.state.store"),
])
def test_a_misspelled_setting_is_refused_with_a_suggestion(key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown setting.*{key} \\(did you mean {suggestion}\\?\\)"):
        StateConf.from_mapping({key: "3"}, **DEFAULTS)


def test_an_unknown_setting_without_a_near_name_lists_the_settings():
    with pytest.raises(ConfigError, match="spark.state.zzz;") as info:
        StateConf.from_mapping({"spark.state.zzz": "1"}, **DEFAULTS)
    assert all(key in str(info.value) for key in KNOWN_KEYS)


@pytest.mark.parametrize("key, value, match", [
    ("spark.state.parallelism", "2.5", "is not an integer"),
    ("spark.state.parallelism", "0", "out of range"),
    ("spark.state.maxParallelism", "40000", "between 1 and 32768"),
    ("spark.state.checkpointsRetained", "1", "out of range"),
    ("spark.state.compression", "gzip", "not one of none, lz4, zstd"),
])
def test_bad_values_name_the_setting(key, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        StateConf.from_mapping({key: value}, **DEFAULTS)
    assert key in str(info.value)
