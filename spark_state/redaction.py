"""What may be a secret, masked in text meant for people: messages, log lines, reports (no I/O, no pyspark).

A user may type a secret into a URI (``http://KEY:SECRET@host``, ``?token=...``) where spark-state takes an
endpoint, a store or a log path. Such text is never echoed as typed: every ``SparkStateError`` passes its message
through ``redact`` (``errors``), and so does every log line or report that quotes a URI a user gave.

``redact`` masks, wherever they appear in ``text`` (also inside another URI's parameters, and percent-encoded):

- the user information of a URI (``scheme://USER:PASSWORD@host`` -> ``scheme://***@host``): a user name typed
  there is often an access key;
- the value of a parameter whose name looks like a secret (``secret_parameter``: ``secret``, ``password``,
  ``token``, ``api_key``, ``signature``, ``credential``, ...) -> ``name=***``.

It is idempotent (``redact(redact(t)) == redact(t)``) and changes nothing else, so a redacted message still names
the path, the bucket, the host and the parameter that was wrong.
"""

from __future__ import annotations

import re

MASK = "***"

_USER_INFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s?#'\"]+)@")
_ENCODED_USER_INFO = re.compile(r"(?i)(?P<scheme>%3A%2F%2F)(?P<user>(?:(?!%2F|%40|[/@&\s'\"]).)+)(?P<at>%40)")
_PARAMETER = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&\s'\"#]*)")
_SECRET_WORD = re.compile(r"(?i)secret|passw|pwd|token|signature|credential|auth")
_SECRET_END = re.compile(r"(?i)(key|keyid|sig)$")


def secret_parameter(name: str) -> bool:
    """Whether a parameter called ``name`` may hold a secret: a name holding ``secret``, ``passw``, ``pwd``,
    ``token``, ``signature``, ``credential`` or ``auth``, or ending in ``key``, ``keyid`` or ``sig`` (``api_key``,
    ``AWSAccessKeyId``; not ``keyColumn``)."""
    return bool(_SECRET_WORD.search(name) or _SECRET_END.search(name))


def redact(text: str) -> str:
    """``text`` with user information and secret-looking parameter values masked (see the module docstring)."""
    if not isinstance(text, str) or ("@" not in text and "=" not in text and "%40" not in text.upper()):
        return text
    text = _USER_INFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _ENCODED_USER_INFO.sub(lambda m: f"{m['scheme']}{MASK}{m['at']}", text)
    return _PARAMETER.sub(lambda m: f"{m['name']}={MASK}" if secret_parameter(m["name"]) else m[0], text)
