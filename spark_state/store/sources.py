"""Source ids, canonical: a source named by a location (``replayable:<log URI>``) is named by the location alone.

A checkpoint records each source's offsets under the source's id, and Spark's
offsets log holds the same id inside each offset. The ``replayable`` source's
id is ``replayable:`` and its log's URI, which a user may spell in several
ways for one log (``s3a://`` or ``s3://``, a trailing '/', its parameters in
another order, an endpoint moved into the AWS settings). So ids are compared
and recorded canonical: the URI part as ``storage.location_identity`` names it,
without client options. Checkpoints written with another spelling read as
the same source (``canonical_sources``).

A keyed query's clock (``datasources.clock``) is a source too, named
``CLOCK_PREFIX`` and its component: it holds no rows, so a query that
continues a state need not start it where the state recorded it
(``is_clock_source``). Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from spark_state.storage import location_identity

SOURCE_ID_KEY = "source_id"
"""The entry of a source's offsets (a JSON object) that names the source."""
CLOCK_PREFIX = "spark-state-clock:"
"""The id of a keyed query's clock source is this and its component's name."""
_LOCATION_ID = re.compile(r"(?P<name>[a-z][a-z0-9_-]*):(?P<uri>(?:[A-Za-z][A-Za-z0-9+.-]*://|/).+)")


def canonical_source_id(source_id: str) -> str:
    """``<name>:<uri>`` with the URI as ``location_identity`` names it; any other id unchanged."""
    match = _LOCATION_ID.fullmatch(source_id) if isinstance(source_id, str) else None
    if match is None:
        return source_id
    return f"{match['name']}:{location_identity(match['uri'])}"


def canonical_offsets(offsets: Any) -> Any:
    """A source's offsets with the id inside them canonical (``canonical_source_id``)."""
    if isinstance(offsets, dict) and isinstance(offsets.get(SOURCE_ID_KEY), str):
        return {**offsets, SOURCE_ID_KEY: canonical_source_id(offsets[SOURCE_ID_KEY])}
    return offsets


def canonical_sources(sources: Mapping[str, Any]) -> dict[str, Any]:
    """Offsets per source id with the ids, keys and inner ones, canonical."""
    return {canonical_source_id(source_id): canonical_offsets(offsets) for source_id, offsets in sources.items()}


def clock_source_id(component: str) -> str:
    """The source id of ``component``'s clock."""
    return CLOCK_PREFIX + component


def is_clock_source(source_id: str) -> bool:
    """Whether ``source_id`` names a keyed query's clock, which holds no rows (see the module docstring)."""
    return isinstance(source_id, str) and source_id.startswith(CLOCK_PREFIX)
