"""The columns a task's input carries beside the stream's own: the names the driver's plan and the task share."""

KEY_GROUP_COLUMN = "_spark_state_key_group"
"""Each row's key group, computed in the JVM (``spark.routing``) and checked by the task (``task``)."""
EVENT_MS_COLUMN = "_spark_state_event_ms"
"""Each row's event time in milliseconds, added by the operator when the query has event time."""
LATE_COLUMN = "_late"
"""With ``late="pass"``, the boolean column that marks a function's late rows."""
