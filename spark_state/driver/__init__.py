"""The driver's decisions, without Spark: settings and the exactly-once protocol of a micro-batch.

- ``conf``: ``spark.state.*`` parsed once into a frozen ``StateConf`` (its table lists every setting);
- ``coordinator``: per micro-batch, run on the latest checkpoint, recompute a committed one, or refuse
  (``plan``); commit the batch's checkpoint bound to Spark's batch (``commit``); clean up.

May import: ``spark_state.errors``, ``spark_state.keyspace``, ``spark_state.model``, ``spark_state.storage``,
``spark_state.store``, ``spark_state.executor`` (the report and task types). No pyspark.
"""
