"""What one instance does in one micro-batch, on an executor (pyarrow and the store; no pyspark).

- ``task``: ``TaskSpec`` (everything a task needs) and ``run_instance`` (the steps of one instance's batch);
  ``report``: the ``InstanceReport`` a task sends the driver.
- ``aggregates``: the built-in aggregates, one ``AggregateDef`` each: **a new aggregate is one entry there**
  (its partials for Spark, its ``KeyedStream`` method and its merge are derived from it).
- ``functions``: user functions (``apply``) and the state API they see (``KeyState``, timers, time to live);
  ``timed``: deduplication and session windows, written with that API.
- ``table``: one instance's keyed state in memory (``KeyGroupTable``; its representations in ``chain``,
  ``search`` and ``order``); ``resident``: that state kept between batches, caught up with the store, bounded
  in memory.

May import: ``spark_state.errors``, ``spark_state.keyspace``, ``spark_state.model``, ``spark_state.storage``,
``spark_state.store``. Never the driver side (``driver``, ``spark``, ``ops``) nor ``hosts``.
"""
