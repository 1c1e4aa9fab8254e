"""Settings: parsed once, validated, unknown keys refused with a suggestion (no Spark but in the last test, which
reads a session's settings)."""

from __future__ import annotations

import pytest

from spark_state.driver.conf import KNOWN_KEYS, StateConf, check_store_reachable, default_store
from spark_state.errors import ConfigError

DEFAULTS = {"default_store": "/state", "default_parallelism": 2}


def test_defaults_and_values():
    conf = StateConf.from_mapping({"spark.state.parallelism": " 5 ", "spark.state.compression": "ZSTD"}, **DEFAULTS)
    assert (conf.store, conf.parallelism, conf.max_parallelism, conf.compression) == ("/state", 5, None, "zstd")
    lazy = StateConf.parse({}.get, default_store=lambda: "/lazy", default_parallelism=3)
    assert (lazy.store, lazy.parallelism) == ("/lazy", 3)


@pytest.mark.parametrize(
    "text, size",
    [
        ("512m", 512 << 20),
        ("4G", 4 << 30),
        ("2gb", 2 << 30),
        ("1048576", 1 << 20),
        ("1t", 1 << 40),
        ("2048k", 2 << 20),
    ],
)
def test_the_memory_bound_is_a_size_as_spark_writes_them(text, size):
    assert StateConf.from_mapping({"spark.state.residentMemory": text}, **DEFAULTS).resident_memory == size
    assert StateConf.from_mapping({}, **DEFAULTS).resident_memory is None


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("spark.state.paralelism", "spark.state.parallelism"),
        ("spark.state.maxparallelism", "spark.state.maxParallelism"),
        ("spark.state.stor", "spark.state.store"),
    ],
)
def test_a_misspelled_setting_is_refused_with_a_suggestion(key, suggestion):
    with pytest.raises(ConfigError, match=f"unknown setting.*{key} \\(did you mean {suggestion}\\?\\)"):
        StateConf.from_mapping({key: "3"}, **DEFAULTS)


def test_an_unknown_setting_without_a_near_name_lists_the_settings():
    with pytest.raises(ConfigError, match="spark.state.zzz;") as info:
        StateConf.from_mapping({"spark.state.zzz": "1"}, **DEFAULTS)
    assert all(key in str(info.value) for key in KNOWN_KEYS)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("spark.state.parallelism", "2.5", "is not an integer"),
        ("spark.state.parallelism", "0", "out of range"),
        ("spark.state.maxParallelism", "40000", "between 1 and 32768"),
        ("spark.state.checkpointsRetained", "1", "out of range"),
        ("spark.state.compression", "gzip", "not one of none, lz4, zstd"),
        ("spark.state.residentMemory", "2 GB", "is not a size"),
        ("spark.state.residentMemory", "1.5g", "is not a size"),
        ("spark.state.residentMemory", "4x", "is not a size"),
        ("spark.state.residentMemory", "512", "below 64k"),
        ("spark.state.residentMemory", "32k", "below 64k"),
    ],
)
def test_bad_values_name_the_setting(key, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        StateConf.from_mapping({key: value}, **DEFAULTS)
    assert key in str(info.value)


def test_s3_settings_become_parameters_of_an_s3_store_uri():
    conf = StateConf.from_mapping(
        {
            "spark.state.store": "s3://bucket/jobs/a",
            "spark.state.s3.endpoint": "http://127.0.0.1:8333",
            "spark.state.s3.pathStyle": "true",
            "spark.state.s3.retrySeconds": "5",
        },
        **DEFAULTS,
    )
    assert conf.store == "s3://bucket/jobs/a?endpoint=http://127.0.0.1:8333&path_style=true&retry_seconds=5"
    assert {f"spark.state.s3.{k}" for k in ("endpoint", "region", "pathStyle", "profile", "retrySeconds")} <= set(
        KNOWN_KEYS
    )


def test_s3_settings_for_a_store_elsewhere_are_refused():
    with pytest.raises(ConfigError, match="spark.state.s3.endpoint apply to an s3:// spark.state.store only"):
        StateConf.from_mapping({"spark.state.s3.endpoint": "http://h:1"}, **DEFAULTS)


def test_a_misspelled_s3_setting_is_refused():
    with pytest.raises(ConfigError, match="did you mean spark.state.s3.pathStyle"):
        StateConf.from_mapping({"spark.state.s3.pathstyl": "true"}, **DEFAULTS)


@pytest.mark.parametrize(
    "store, master, refused",
    [
        ("/data/state", "local[2]", False),
        ("file:///data/state", "local-cluster[2,1,1024]", False),
        ("/data/state", "spark://10.0.0.1:7077", True),
        ("file:///data/state", "yarn", True),
        ("memory://x", "k8s://https://api:443", True),
        ("s3://bucket/state", "spark://10.0.0.1:7077", False),
        ("webhdfs://nn:9870/state", "yarn", False),
    ],
)
def test_a_local_store_is_refused_on_a_non_local_master(store, master, refused):
    if refused:
        with pytest.raises(ConfigError, match="on local disk, but the master") as info:
            check_store_reachable(store, master)
        assert "s3://" in str(info.value) and "webhdfs://" in str(info.value)
    else:
        check_store_reachable(store, master)


@pytest.mark.parametrize(
    "store, refused", [("/mnt/nfs/state", False), ("file:///mnt/nfs/state", False), ("memory://x", True)]
)
def test_a_shared_local_store_is_accepted_on_a_cluster_when_declared(store, refused):
    assert StateConf.from_mapping(
        {"spark.state.store": store, "spark.state.sharedLocalStore": "TRUE"},
        default_store="/unused",
        default_parallelism=2,
    ).shared_local_store
    if refused:
        with pytest.raises(ConfigError, match="on local disk"):
            check_store_reachable(store, "spark://10.0.0.1:7077", shared=True)
    else:
        check_store_reachable(store, "spark://10.0.0.1:7077", shared=True)


def test_the_error_for_a_local_store_on_a_cluster_names_the_shared_mount_setting():
    with pytest.raises(ConfigError, match="spark.state.sharedLocalStore=true"):
        check_store_reachable("/data/state", "yarn")


def test_shared_local_store_must_be_true_or_false():
    with pytest.raises(ConfigError, match="spark.state.sharedLocalStore='yes' is not true or false"):
        StateConf.from_mapping({"spark.state.sharedLocalStore": "yes"}, default_store="/s", default_parallelism=2)


@pytest.mark.parametrize(
    "location, store",
    [
        ("/chk/q1", "/chk/q1/state"),
        ("/chk/q1/", "/chk/q1/state"),
        ("file:///chk/q1", "/chk/q1/state"),
        ("webhdfs://127.0.0.1:9870/chk/q1", "webhdfs://127.0.0.1:9870/chk/q1/state"),
        ("s3a://bucket/chk/q1", "s3://bucket/chk/q1/state"),
        ("s3://bucket/chk/q1", "s3://bucket/chk/q1/state"),
    ],
)
def test_the_default_store_sits_beside_the_checkpoint(location, store):
    assert default_store(location) == store


@pytest.mark.parametrize(
    "location, match",
    [
        ("hdfs://namenode:8020/chk", "RPC port"),
        ("gs://bucket/chk", "cannot store state on by default"),
        ("abfs://container@account.dfs.core.windows.net/chk", "cannot store state on by default"),
    ],
)
def test_a_default_store_that_cannot_work_is_refused_with_the_fix(location, match):
    with pytest.raises(ConfigError, match=match) as info:
        default_store(location)
    assert "spark.state.store" in str(info.value)


def test_the_default_store_of_an_s3a_checkpoint_takes_the_s3_settings():
    conf = StateConf.from_mapping(
        {"spark.state.s3.region": "eu-west-1"}, default_store=default_store("s3a://b-1/c"), default_parallelism=2
    )
    assert conf.store == "s3://b-1/c/state?region=eu-west-1"


def test_the_key_space_is_the_setting_else_the_store_s_else_a_new_store_s_default():
    unset = StateConf.from_mapping({"spark.state.parallelism": "40"}, **DEFAULTS)
    assert unset.key_space(None) == 2048  # 32 key groups per instance, rounded up to a power of two
    assert unset.key_space(4096) == 4096  # a store keeps the key space it was created with
    with pytest.raises(
        ConfigError, match="spark.state.parallelism=40 must be between 1 and the key space of the store, 16"
    ):
        unset.key_space(16)
    set_ = StateConf.from_mapping({"spark.state.parallelism": "40", "spark.state.maxParallelism": "64"}, **DEFAULTS)
    assert set_.key_space(None) == set_.key_space(4096) == 64  # another stored value is refused on restore
    with pytest.raises(
        ConfigError, match="spark.state.parallelism=65 must be between 1 and spark.state.maxParallelism=64"
    ):
        StateConf.from_mapping({"spark.state.parallelism": "65", "spark.state.maxParallelism": "64"}, **DEFAULTS)
    with pytest.raises(ConfigError, match="must be between 1 and 32768, the largest key space"):
        StateConf.from_mapping({"spark.state.parallelism": "40000"}, **DEFAULTS)


def test_a_query_start_advises_unix_sockets_once_when_python_tasks_use_tcp(monkeypatch, caplog):
    from types import SimpleNamespace

    from spark_state.spark import streaming

    def session(value):
        conf = {} if value is None else {streaming.UNIX_SOCKETS: value}
        java_conf = SimpleNamespace(get=conf.get)  # the context's SparkConf in the JVM
        return SimpleNamespace(  # a classic session: a JVM (over Spark Connect the server's settings are not ours)
            _jsparkSession=object(),
            sparkContext=SimpleNamespace(_jsc=SimpleNamespace(sc=lambda: SimpleNamespace(conf=lambda: java_conf))),
        )

    monkeypatch.setattr(streaming, "_advised", [])
    assert not streaming.advise_unix_sockets(session("true"))
    assert streaming.advise_unix_sockets(session(None))  # unset: TCP
    assert "spark.python.unix.domain.socket.enabled is off" in caplog.text
    assert not streaming.advise_unix_sockets(session("false"))  # once per driver


@pytest.mark.spark
def test_a_session_s_settings_are_read_whole_whatever_their_values_hold(spark):
    """The session's settings come in one string of ``key -> value`` entries: values with commas, brackets or
    line breaks are read whole, and a NUL in one (which would split the string wrongly) makes them read a key
    at a time. The parallelism defaults to the session's shuffle partitions."""
    for store in ("/tmp/a,b (c)\nd", "/tmp/nul\0here"):
        spark.conf.set("spark.state.store", store)
        try:
            conf = StateConf.from_session(spark, default_store="/unused")
        finally:
            spark.conf.unset("spark.state.store")
        assert (conf.store, conf.parallelism) == (store, int(spark.conf.get("spark.sql.shuffle.partitions")))
    spark.conf.set("spark.state.paralelism", "3")
    try:
        with pytest.raises(ConfigError, match="did you mean spark.state.parallelism"):
            StateConf.from_session(spark, default_store="/unused")
    finally:
        spark.conf.unset("spark.state.paralelism")


def test_on_a_cluster_the_memory_bound_defaults_to_half_of_what_spark_gives_the_executor_s_python():
    from spark_state.driver.conf import default_resident_memory

    mib = 1 << 20
    assert default_resident_memory({"spark.executor.pyspark.memory": "2g"}, "local[2]") is None
    assert default_resident_memory({"spark.executor.pyspark.memory": "2g"}, "spark://h:7077") == 1024 * mib
    assert default_resident_memory({"spark.executor.memoryOverhead": "1000"}, "yarn") == 500 * mib  # bare: MiB
    assert default_resident_memory({"spark.executor.memory": "8g"}, "k8s://h") == int(0.5 * 0.1 * 8192 * mib)
    assert default_resident_memory({}, "spark://h:7077") == 192 * mib  # 384m, the least overhead Spark gives
    factor = {"spark.executor.memory": "8g", "spark.executor.memoryOverheadFactor": "0.4"}
    assert default_resident_memory(factor, "yarn") == int(0.5 * 0.4 * 8192 * mib)
    with pytest.raises(ConfigError, match="spark.executor.pyspark.memory"):
        default_resident_memory({"spark.executor.pyspark.memory": "lots"}, "yarn")


def test_none_is_no_memory_bound_on_any_master():
    conf = StateConf.from_mapping({"spark.state.residentMemory": "None"}, default_store="/s", default_parallelism=2)
    assert conf.resident_memory is None
