"""The state store: what a checkpoint is, how it is written, committed, kept, restored and cleaned up.

Over one ``storage.Storage``:

- ``blob``: the blob format (one Arrow IPC file per instance and checkpoint, an index of per-key-group entries);
- ``blobstore``: the executor's side (write and fetch blobs and instance items, checksummed);
- ``manifest``: what a committed checkpoint holds and how the next one is derived; ``commitlog``: the log of
  numbered commit records every log of commits uses; ``manifestlog``: the driver's side (the commit point,
  retention, cleanup);
- ``restore``: the pure plan of which byte ranges a new instance reads; ``chains``: which stored chain a key
  group's state reflects and what the next checkpoint writes (compaction);
- ``savepoints`` and ``startfrom``: named checkpoints and starting a store from one;
- ``stops`` and ``drain``: the records a running query's driver and hosts exchange through the store.

May import: ``spark_state.errors``, ``spark_state.keyspace``, ``spark_state.model``, ``spark_state.storage``.
"""
