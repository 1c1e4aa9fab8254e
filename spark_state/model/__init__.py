"""What keyed state is, independent of where it is kept: its schema, its variables, time. Pure: no I/O, no pyspark.

- ``schema``: a component's key columns and named state variables (``KeyedSchema``, ``StateVariable``), and how
  they are laid out in a blob; the recipe for a new state variable is in its docstring.
- ``evolution``: which changes of a state schema a restart may make, and the cast.
- ``eventtime``: event time, watermarks and durations.
- ``timers``: the ``timers`` state variable (event- and processing-time timers, time-to-live expiries) and the
  index that finds the due ones.
- ``instance_items``: the non-keyed state of one instance and how it is redistributed on rescale.

May import: ``spark_state.errors``, ``spark_state.keyspace``.
"""
