"""Operating stores from outside a query: the ``spark-state`` CLI, reading state out, the main job.

- ``cli``: the ``spark-state`` commands, one function each: **a new CLI command is one decorated function
  there** (``@cli.command()``), built on the functions below;
- ``inspect``: describe, plan a rescale, verify (pure functions over a store's records);
- ``reader``: ``read_state`` (a component's keys and values as Arrow, without Spark);
- ``main``: ``./run main``, a streaming job restarted at three parallelisms.

May import: everything in spark-state.
"""
