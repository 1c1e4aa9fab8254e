"""Where an S3 store lives: ``s3://BUCKET[/PREFIX][?PARAMS]`` parsed into a frozen ``S3Location`` (no I/O, no boto3).

The URI carries everything an executor needs to reach the store besides
credentials, because executors open a store from its URI alone:

==================  ==========================  =====================================================
URI parameter       setting                     meaning
==================  ==========================  =====================================================
``endpoint``        ``spark.state.s3.endpoint``   ``http(s)://HOST[:PORT]`` of an S3-compatible store;
                                                  default: the AWS chain (``AWS_ENDPOINT_URL_S3``,
                                                  ``AWS_ENDPOINT_URL``, ``endpoint_url`` in the config
                                                  file), else AWS itself
``region``          ``spark.state.s3.region``     signing region; default: the AWS chain
                                                  (``AWS_REGION``, ``AWS_DEFAULT_REGION``, config
                                                  file), else ``us-east-1``
``path_style``      ``spark.state.s3.pathStyle``  ``true``: ``ENDPOINT/BUCKET/KEY`` addressing (most
                                                  S3-compatible stores); ``false``: virtual-hosted;
                                                  default: the config file's ``addressing_style``
``profile``         ``spark.state.s3.profile``    a named profile of the AWS config and credentials
                                                  files (the name travels, never a key)
``retry_seconds``   ``spark.state.s3.retrySeconds``  how long transient failures are retried (default
                                                  30)
==================  ==========================  =====================================================

Credentials never appear in a URI: they come from the standard AWS chain
(environment, shared credentials and config files, SSO, container or
instance role) of each process that opens the store, so no secret is ever
serialized into a task, a manifest, a log line or an error. ``s3a://`` is
accepted as a spelling of ``s3://`` (Hadoop's); ``uri`` is always ``s3://``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from urllib.parse import parse_qs, quote, unquote, urlsplit

from spark_state.errors import ConfigError, InvalidPathError
from spark_state.storage.base import Backend, check_path

SCHEMES = ("s3", "s3a")
DEFAULT_RETRY_SECONDS = 30.0
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PROFILE = re.compile(r"[A-Za-z0-9._@+=,-]+")
_REGION = re.compile(r"[a-z0-9-]+")

PARAMETERS = {
    "endpoint": "endpoint",
    "region": "region",
    "path_style": "pathStyle",
    "profile": "profile",
    "retry_seconds": "retrySeconds",
}
"""URI parameter -> the ``spark.state.s3.*`` setting that supplies it (see the module docstring)."""
ALIASES = {setting: parameter for parameter, setting in PARAMETERS.items() if setting != parameter}
"""A URI parameter may be spelled as its setting is (``pathStyle``, ``retrySeconds``): one name everywhere."""

USAGE = (
    "s3://BUCKET/PREFIX[?endpoint=http://HOST:PORT&region=REGION&path_style=true&profile=NAME&retry_seconds=N] "
    "(credentials come from the AWS environment and config files, never from the URI)"
)


@dataclass(frozen=True)
class S3Location:
    """A bucket, a key prefix in it ('' or a clean relative path) and how to reach it; see the module docstring."""

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str | None = None
    path_style: bool | None = None
    profile: str | None = None
    retry_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise ConfigError(
                f"invalid S3 bucket name {self.bucket!r}: 3-63 lowercase letters, digits, '.' or '-', "
                "starting and ending with a letter or digit"
            )
        if self.prefix:
            try:
                check_path(self.prefix)
            except InvalidPathError as err:
                raise ConfigError(f"invalid S3 key prefix {self.prefix!r}: {err}") from err
        if self.endpoint is not None:
            _check_endpoint(self.endpoint)
        if self.region is not None and not _REGION.fullmatch(self.region):
            raise ConfigError(f"invalid S3 region {self.region!r}: use a region name like 'eu-west-1'")
        if self.profile is not None and not _PROFILE.fullmatch(self.profile):
            raise ConfigError(f"invalid AWS profile name {self.profile!r}")
        if self.retry_seconds is not None and not (
            isinstance(self.retry_seconds, (int, float))
            and math.isfinite(self.retry_seconds)
            and 0 <= self.retry_seconds <= 3600
        ):
            raise ConfigError(f"invalid S3 retry_seconds {self.retry_seconds!r}: use a number of seconds in [0, 3600]")

    @property
    def uri(self) -> str:
        """The canonical ``s3://`` URI: parameters that are set, in a fixed order; ``parse(uri) == self``."""
        path = f"/{quote(self.prefix, safe='/')}" if self.prefix else ""
        params = []
        for name in PARAMETERS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, float):
                text = f"{value:g}"
            else:
                text = str(value)
            params.append(f"{name}={quote(text, safe=':/')}")
        return f"s3://{self.bucket}{path}" + (f"?{'&'.join(params)}" if params else "")

    def describe(self) -> str:
        """``s3://bucket/prefix`` at the endpoint, for messages (no parameters beyond the endpoint)."""
        where = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        return where + (f" at {self.endpoint}" if self.endpoint else "")

    def with_settings(self, settings: dict[str, str | None]) -> S3Location:
        """This location with ``settings`` (URI parameter -> text, None: unset) filled in.

        A parameter the URI already carries with another value is a
        ``ConfigError``: one store has one endpoint.
        """
        changes = {}
        for name, text in settings.items():
            if text is None:
                continue
            value = _parse_value(name, text, f"setting spark.state.s3.{PARAMETERS[name]}")
            current = getattr(self, name)
            if current is not None and current != value:
                raise ConfigError(
                    f"spark.state.s3.{PARAMETERS[name]}={text!r} conflicts with {name}={current!r} in the store "
                    f"URI {self.uri}; set it in one place"
                )
            changes[name] = value
        return replace(self, **changes)


def apply_settings(uri: str, settings: dict[str, str | None]) -> str:
    """``uri`` with ``settings`` (URI parameter -> text, None: unset) added when it names an S3 location; any other
    URI unchanged. A parameter the URI already gives with another value is a ``ConfigError``."""
    if not is_s3_uri(uri) or not any(text is not None for text in settings.values()):
        return uri
    return parse(uri).with_settings(settings).uri


def is_s3_uri(uri: str) -> bool:
    """Whether ``uri`` names an S3 store (``s3://`` or ``s3a://``)."""
    return isinstance(uri, str) and uri.split(":", 1)[0].lower() in SCHEMES and "://" in uri


def parse(uri: str) -> S3Location:
    """The ``S3Location`` of ``uri``; ``ConfigError`` if it is not a valid S3 store URI.

    Errors name the URI without anything that could be a secret (user info,
    values of unknown parameters).
    """
    safe = redacted(uri)
    try:
        parts = urlsplit(uri)
    except ValueError as err:
        raise ConfigError(f"invalid S3 URI {safe!r}: {err}; use {USAGE}") from None
    if parts.scheme.lower() not in SCHEMES or not parts.netloc or parts.fragment:
        raise ConfigError(f"invalid S3 URI {safe!r}: use {USAGE}")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ConfigError(
            f"invalid S3 URI {safe!r}: the host part is the bucket name alone; put an endpoint in "
            f"?endpoint=... and credentials in the AWS environment or config files. Use {USAGE}"
        )
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ConfigError(f"invalid S3 URI {safe!r}: malformed query string; use {USAGE}") from None
    for alias, name in ALIASES.items():  # pathStyle=... as path_style=...
        if alias in query:
            if name in query:
                raise ConfigError(f"invalid S3 URI {safe!r}: give {name} once (it is also spelled {alias})")
            query[name] = query.pop(alias)
    unknown = sorted(set(query) - set(PARAMETERS))
    if unknown:
        raise ConfigError(
            f"invalid S3 URI {safe!r}: unknown parameter(s) {unknown}; the parameters are {sorted(PARAMETERS)} "
            "(credentials never go in the URI)"
        )
    try:
        values = {}
        for name, texts in query.items():
            if len(texts) != 1 or not texts[0]:
                raise ConfigError(f"give parameter {name} once, with a value")
            values[name] = _parse_value(name, texts[0], f"parameter {name}")
        return S3Location(parts.netloc, unquote(parts.path).strip("/"), **values)
    except ConfigError as err:
        raise ConfigError(f"invalid S3 URI {safe!r}: {err}") from None


def redacted(uri: str) -> str:
    """``uri`` for a message: user info dropped, the values of parameters other than ``PARAMETERS`` masked."""
    try:
        parts = urlsplit(str(uri))
    except ValueError:
        return "<unparseable URI>"
    host = parts.netloc.rsplit("@", 1)[-1]
    params = []
    for pair in parts.query.split("&") if parts.query else []:
        name, _, value = pair.partition("=")
        params.append(pair if name in PARAMETERS or name in ALIASES else f"{name}=***")
    return f"{parts.scheme}://{host}{parts.path}" + (f"?{'&'.join(params)}" if params else "")


def _parse_value(name: str, text: str, where: str):
    text = str(text).strip()
    if name == "path_style":
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"{where}={text!r} must be true or false")
        return text.lower() == "true"
    if name == "retry_seconds":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}={text!r} is not a number of seconds") from None
    if name == "endpoint":
        return _check_endpoint(text.rstrip("/"))
    return text


def _check_endpoint(endpoint: str) -> str:
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ConfigError(f"invalid S3 endpoint {endpoint!r}: use http(s)://HOST[:PORT] with no path or credentials")
    return endpoint


def open_s3(uri: str):
    """``s3://BUCKET[/PREFIX][?...]`` (``s3a://`` too): an ``S3Storage``, whose module imports boto3."""
    from spark_state.storage.s3 import S3Storage

    return S3Storage(parse(uri))


def preload_s3(uri: str) -> None:
    """Import boto3, read its service models and resolve credentials as the first client does; send nothing."""
    open_s3(uri).client()


def s3_identity(uri: str) -> str:
    """``s3://BUCKET[/PREFIX]``: ``s3a://`` is the same bucket, and every URI parameter a client's option."""
    location = parse(uri)
    return f"s3://{location.bucket}" + (f"/{location.prefix}" if location.prefix else "")


BACKEND = Backend(
    SCHEMES,
    open_s3,
    "s3://BUCKET/PREFIX (optional ?endpoint=URL&region=R&path_style=true&profile=NAME&retry_seconds=N)",
    preload=preload_s3,
    identity=s3_identity,
)
