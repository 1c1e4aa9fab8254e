"""No secret a user types reaches a message, a log line or a report (``spark_state.redaction``).

A key and a secret are typed into every place a user could: the endpoint setting, a store URI on the command line
and in ``spark.conf``, the ``replayable`` log's path; each place's errors, logs and output are searched for them.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from spark_state.driver.conf import StateConf
from spark_state.errors import ConfigError, SparkStateError
from spark_state.ops.cli import cli
from spark_state.redaction import MASK, redact

KEY, SECRET = "AKIAEXAMPLEKEY4242", "wJalrXUtnFEMIexamplesecret"


def _typed(where: str) -> list[str]:
    """The ways a user might type ``KEY`` and ``SECRET`` into a URI that goes ``where``."""
    return {
        "endpoint": [f"http://{KEY}:{SECRET}@127.0.0.1:1", f"https://{KEY}:{SECRET}@s3.example.com"],
        "store": [
            f"s3://bucket/state?endpoint=http://{KEY}:{SECRET}@127.0.0.1:1",
            f"s3://{KEY}:{SECRET}@bucket/state",
            f"s3://bucket/state?endpoint=http%3A%2F%2F{KEY}%3A{SECRET}%40127.0.0.1%3A1",
            f"s3://bucket/state?aws_secret_access_key={SECRET}&access_key={KEY}",
            f"webhdfs://{KEY}:{SECRET}@127.0.0.1:1/state",
            f"file://{KEY}:{SECRET}@localhost/state",
        ],
    }[where]


def _clean(text: str) -> bool:
    return KEY not in text and SECRET not in text


@contextlib.contextmanager
def _our_logs(caplog):
    """Every record of spark-state's loggers, at any level, and the warnings of everything else (py4j's own debug
    log repeats each call sent to the JVM, the setting a user made included)."""
    with caplog.at_level(logging.DEBUG, logger="spark_state"), caplog.at_level(logging.DEBUG, logger="datasources"):
        yield


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            f"s3://b/p?endpoint=http://{KEY}:{SECRET}@host:8333&path_style=true",
            f"s3://b/p?endpoint=http://{MASK}@host:8333&path_style=true",
        ),
        (f"'http://{KEY}@host'", f"'http://{MASK}@host'"),
        (f"x?api_key={SECRET}&keyColumn=user&token={SECRET}", f"x?api_key={MASK}&keyColumn=user&token={MASK}"),
        (f"http%3A%2F%2F{KEY}%3A{SECRET}%40host", f"http%3A%2F%2F{MASK}%40host"),
        (
            "spark.state.maxParallelism=32768 for user@example.com",
            "spark.state.maxParallelism=32768 for user@example.com",
        ),
    ],
)
def test_redact_masks_user_information_and_secret_parameters_and_nothing_else(text, expected):
    assert redact(text) == expected


@given(st.text(alphabet="ab:/@?=&%34AF_-.tokenkeyc", max_size=60))
def test_redact_is_idempotent(text):
    assert redact(redact(text)) == redact(text)


def test_every_error_of_ours_is_redacted_however_it_was_made():
    error = ConfigError(f"bad endpoint http://{KEY}:{SECRET}@host")
    assert _clean(str(error)) and _clean(repr(error)) and "host" in str(error)
    import pickle

    assert _clean(str(pickle.loads(pickle.dumps(error))))  # also once it crossed to the driver


@pytest.mark.parametrize("endpoint", _typed("endpoint"))
def test_the_endpoint_setting_is_refused_without_echoing_the_secret(endpoint):
    with pytest.raises(ConfigError) as error:
        StateConf.from_mapping(
            {"spark.state.store": "s3://bucket/state", "spark.state.s3.endpoint": endpoint},
            default_store="/unused",
            default_parallelism=2,
        )
    assert _clean(str(error.value)) and "127.0.0.1" in str(error.value) or "s3.example.com" in str(error.value)


@pytest.mark.parametrize("store", _typed("store"))
def test_a_store_uri_in_the_settings_is_refused_without_echoing_the_secret(store):
    with pytest.raises(SparkStateError) as error:
        conf = StateConf.from_mapping({"spark.state.store": store}, default_store="/unused", default_parallelism=2)
        from spark_state.storage import open_storage

        open_storage(conf.store)
    assert _clean(str(error.value)), str(error.value)


@pytest.mark.parametrize("store", _typed("store"))
@pytest.mark.parametrize(
    "command",
    [
        ["verify", "{}"],
        ["checkpoints", "{}"],
        ["describe", "{}"],
        ["cleanup", "{}", "--dry-run"],
        ["savepoint", "list", "{}"],
        ["drain", "{}", "0f1e2d3c-0000-4000-8000-000000000001"],
        ["savepoint", "{}"],
    ],
)
def test_a_store_uri_on_the_command_line_is_refused_without_echoing_the_secret(store, command, caplog):
    with _our_logs(caplog):
        result = CliRunner().invoke(cli, [store if word == "{}" else word for word in command])
    assert result.exit_code != 0
    assert _clean(result.output) and _clean(caplog.text), result.output


@pytest.mark.spark
def test_secrets_typed_into_a_query_s_settings_and_a_log_path_reach_no_error_or_log(spark, tmp_path, caplog, capfd):
    import datasources
    from spark_state import keyed

    datasources.register(spark)
    for setting, value in [
        ("spark.state.store", _typed("store")[0]),
        ("spark.state.s3.endpoint", _typed("endpoint")[0]),
    ]:
        spark.conf.set(setting, value)
        if setting == "spark.state.s3.endpoint":
            spark.conf.set("spark.state.store", "s3://bucket/state")
        try:
            events = spark.readStream.format("rate").load()
            with _our_logs(caplog), pytest.raises(SparkStateError) as error:
                keyed(events, "value", name="c").count().writeStream.format("console").option(
                    "checkpointLocation", str(tmp_path / setting)
                ).start()
            assert _clean(str(error.value)) and _clean(caplog.text)
        finally:
            spark.conf.unset(setting)
            spark.conf.unset("spark.state.store")
    for path in _typed("store")[:2]:
        with _our_logs(caplog), pytest.raises(Exception) as error:
            spark.readStream.format("replayable").option("path", path).load().writeStream.format("console").option(
                "checkpointLocation", str(tmp_path / "log")
            ).start().processAllAvailable()
        assert _clean(str(error.value)) and _clean(caplog.text), str(error.value)[:2000]
    captured = capfd.readouterr()
    assert _clean(captured.out) and _clean(captured.err)
