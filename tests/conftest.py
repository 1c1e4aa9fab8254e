"""Shared fixtures. One Spark session and one S3 server per test worker, each created only if a test asks for it.

Every process of the test run (this one, Spark's JVMs and Python workers,
the cluster test's daemons) finds AWS credentials the standard way, in the
AWS config and credentials files, which point into a directory of this worker:
set here, before any JVM starts, so that every child inherits them, and
filled by the ``s3_server`` fixture. Settings of the machine (``AWS_*``
variables, ``~/.aws``) never leak into the tests.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

AWS_DIR = Path(tempfile.mkdtemp(prefix="spark-state-aws-"))
AWS_CONFIG_FILE = AWS_DIR / "config"
AWS_CREDENTIALS_FILE = AWS_DIR / "credentials"


def pytest_configure(config):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    AWS_CONFIG_FILE.write_text("")
    AWS_CREDENTIALS_FILE.write_text("")
    os.environ["AWS_CONFIG_FILE"] = str(AWS_CONFIG_FILE)
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(AWS_CREDENTIALS_FILE)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-role lookups (1 s timeouts) on a test machine


SLOWEST_FILES = (
    "test_benchmarks.py",
    "test_connect_spark.py",
    "test_keyed_spark.py",
    "test_driver_kill.py",
    "test_cluster.py",
    "test_campaign.py",
    "test_time_spark.py",
    "test_idle_spark.py",
    "test_state_machine.py",
    "test_replayable_spark.py",
    "test_two_drivers.py",
    "test_ops_spark.py",
    "test_remote_storage_spark.py",
    "test_locations.py",
)
"""The files that take 20 s or more, longest first (measured per file in a two-worker run)."""


def pytest_collection_modifyitems(config, items):
    """Run the slowest files first: ``./run tests`` hands whole files to two workers (``--dist loadfile``) in
    this order (``--no-loadscope-reorder``), so a long file never starts last while the other worker sits idle."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_runtest_setup(item):
    """Before a worker's first test that starts Spark: the drivers' class archive (``tests/jvm.py``), made once."""
    if item.get_closest_marker("spark") or item.get_closest_marker("cluster"):
        from tests.jvm import ensure_class_archive

        ensure_class_archive()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test of the Spark session gets where every thread was (``tests/diagnostics.py``) in its report."""
    report = yield
    if report.when == "call" and report.failed and "spark" in item.funcargs:
        from tests.diagnostics import failure_sections

        for title, text in failure_sections(item.funcargs["spark"], call.start):
            report.sections.append((f"spark-state: {title}", text))
    return report


def pytest_unconfigure(config):
    shutil.rmtree(AWS_DIR, ignore_errors=True)


FAST_LOCAL_CHECKPOINTS = {
    "spark.sql.streaming.checkpointFileManagerClass": "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
}
"""How the session writes Spark's own checkpoint files (offsets, commits, sources' logs, Spark's state stores) on
local disk. Without Hadoop's native library (the pip package has none), Spark's default manager (through
Hadoop's ``FileContext``) runs ``readlink`` as a child process of the JVM for each file it writes or renames:
about 40 ms of each of a micro-batch's offsets, commit and source log writes, a third of a small batch's time
(measured on a trivial query: 482 ms per batch by default, 340 ms with this). The files, their names and the
rename of a temporary file that publishes each are the same, so the in-process tests use it; the tests that
kill a driver while it writes these files (``driver_job``, the campaign, two drivers, the cluster) run Spark's
defaults, as do the benchmarks and ``./run main``. (Hadoop's raw local file system, which would also drop the
``chmod`` children and ``.crc`` files, breaks ``FileSystem.getLocal``, which RocksDB's state store uses.)"""


@pytest.fixture(scope="session")
def spark():
    """A ``local[2]`` session with 2 shuffle partitions, UI and AQE off; see ``FAST_LOCAL_CHECKPOINTS``."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from spark_state.spark.streaming import UNIX_SOCKETS
    from tests.jvm import driver_jvm_options

    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark-state-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config(UNIX_SOCKETS, "true")  # Python tasks without TCP's delayed ACKs
        .config("spark.ui.enabled", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.driver.extraJavaOptions", driver_jvm_options())
        .config(map=FAST_LOCAL_CHECKPOINTS)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # The clock (on by default) costs each query's start a Python source runner, 1.5-2 s here, which most
        # tests' dozens of queries do not need: its tests, the campaign's and the subprocess drivers' run with it.
        .config("spark.state.clock", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS's S3 gateway on loopback (``tests/s3_server.py``), its credentials in the AWS files of the run."""
    from tests.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.write_aws_files(AWS_CONFIG_FILE, AWS_CREDENTIALS_FILE)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    """One bucket for the run; tests keep apart by prefix (``s3_uri``)."""
    return s3_server.create_bucket("spark-state-tests")


@pytest.fixture
def s3_uri(s3_server, s3_bucket):
    """``s3_uri(name)``: a fresh ``s3://`` store URI on the test server (endpoint and path style in the URI)."""
    unique = uuid.uuid4().hex[:12]
    return lambda name="store": s3_server.uri(s3_bucket, f"{unique}/{name}")
