"""The session's S3 settings (``spark.state.s3.*``) for the data sources, which Spark never shows them.

Spark hands a Python data source its options only, not the session's
settings. So ``datasources.register(spark)`` registers each source as a
subclass carrying the settings in force then (``with_session_settings``); its
location options (``path``, ``stateStore``, ``store``) that name an ``s3://``
location get them as URI parameters, exactly as a query's store does
(``driver.conf``). A parameter a location gives itself with another value is
refused, as a store's is. Sources registered by Spark on its own (the
installed ``pyspark_*`` modules) see no session: there, give the parameters in
the URI, or through the AWS settings of every process (``AWS_ENDPOINT_URL``,
the config file).
"""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql.datasource import CaseInsensitiveDict

from spark_state.driver.conf import S3_KEYS
from spark_state.storage.s3_location import apply_settings

LOCATION_OPTIONS = ("path", "stateStore", "store")
"""Options that name a location, to which the session's S3 settings apply."""


def session_settings(spark) -> dict[str, str]:
    """The session's ``spark.state.s3.*`` settings that are set, as URI parameter -> text."""
    found = {}
    for key, parameter in S3_KEYS.items():
        value = spark.conf.get(key, None)
        if value is not None and str(value).strip():
            found[parameter] = str(value).strip()
    return found


def applied(options: Mapping[str, str], settings: Mapping[str, str]) -> CaseInsensitiveDict:
    """``options`` with ``settings`` added to each location option that names an S3 location."""
    merged = CaseInsensitiveDict(dict(options))
    for name in LOCATION_OPTIONS:
        if name in merged and merged[name]:
            merged[name] = apply_settings(merged[name], dict(settings))
    return merged


def with_session_settings(source: type, settings: Mapping[str, str]) -> type:
    """``source`` (a ``DataSource`` class) whose instances take ``settings`` (``applied``); ``source`` itself when
    there are none."""
    if not settings:
        return source
    frozen = dict(settings)

    def __init__(self, options):
        source.__init__(self, applied(options, frozen))

    return type(
        source.__name__, (source,), {"__init__": __init__, "__module__": source.__module__, "S3_SETTINGS": frozen}
    )
