"""The Spark edge: the user API of keyed queries and the driver's Spark calls. The only package that needs pyspark.

- ``streaming``: ``keyed()``, ``KeyedStream``, ``StatefulQuery`` (the API);
- ``microbatch``: the driver's part of every micro-batch, the Spark calls around ``driver.coordinator``;
- ``plan``: the optional accelerator that reuses a batch's analysed plan (Catalyst internals);
- ``routing``: key groups and instances as Column expressions (the same functions as ``keyspace``);
- ``checkpoint``: what Spark's checkpoint says about a batch; ``sinks``: writing a batch's output once per
  batch id; ``stop_watch``: noticing a query that ended.

May import: every other package of spark-state but ``ops``, and pyspark.
"""
