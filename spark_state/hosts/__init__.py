"""Instance hosts: one long-lived process per instance and executor, so state survives Spark's task placement.

Spark hands a task to whichever Python worker is idle, so the worker that
ran instance i last batch is often not the one that runs it next; state kept
in the worker (``resident``) then had to be reloaded from the store, costing
a multiple of a normal batch at millions of keys. With hosts, the task's
worker is only a courier: ``run_hosted(task, instance, batches)`` sends the
task and its input rows to the host of (this executor, store, component,
instance) over a Unix socket, and relays the output rows the host's
``executor.task.run_instance`` produces. The host keeps the instance's state
between batches, whichever worker carries the next task.

Protocol (one connection per task; a host serves one connection at a time,
so two attempts of one instance never run at once): after the handshake in
which each end proves it belongs to the executor (``trust``), the
worker sends frames ``TASK`` (the pickled task and instance), ``BATCH`` (one Arrow IPC stream per
input record batch) and ``END``; the host restores the instance as soon as
the task comes, reads the rows while Spark is still preparing them, and
answers ``BATCH`` frames of output and ``END``, or, once it has read the
rows, ``ERROR`` (the pickled exception, re-raised in the worker, so a typed
error reaches the driver as it would without hosts). A worker that
sees the connection close without ``END`` raises ``InstanceHostLostError``:
the task fails and Spark retries it, which starts a new host. A worker waits
for an answer as long as it takes, but one that has waited a minute writes to
the executor's log which host it waits for and that host's stacks
(``worker``).

Lifetime: a worker starts the host when none answers (under a file lock, so
two workers start one). It first asks idle hosts of its executor that the
store no longer needs, spares first, to serve the instance instead
(``adoption``): a host whose run stopped, whose store was deleted or that was
rescaled away from its instance, idle at least ``adoption.ADOPT_IDLE_SECONDS`` and
holding at most ``adoption.ADOPT_MAX_KEYS`` keys, drops its state and moves to the
new address; a new host's first task would otherwise copy every page it
touches from its worker (a large share of a restart's CPU). Only when none agrees does the worker fork one
(forking skips an interpreter start-up, which would cost each new instance
a third of a second; the worker reaps it once it has exited). An obsolete
host that no worker adopted becomes a spare holding nothing (``adoption.spare``,
at most ``adoption.SPARE_HOSTS`` per executor, none under a memory bound, each leaving after
``policy.IDLE_SECONDS``),
so that a restart in the same application, or a later rescale, takes
warm hosts as PySpark's idle workers are taken. The host exits when the
executor's Python daemon (its starter's parent, which lives as long as the
executor) is gone, after ``policy.idle_limit``
without a task (``policy.IDLE_SECONDS``, or three times its recent gaps between
tasks when they are longer, so that a query with a slow trigger keeps its
state between batches), or as soon as an idle host finds that the store has
no more use for its state (``policy.obsolete``: the run of its last task was
stopped, the query was rescaled away from its instance, the instance ran
since on another executor, or the store was deleted) and enough spares wait, so that the memory of stopped, rescaled
or removed queries does not linger. It keeps the worker's process group and
environment, and none of its descriptors, resident states or storage
clients. SIGTERM or SIGHUP make
it leave, its socket removed, even when Python drops the handler's exit (one
raised inside a finalizer or a garbage-collection hook): the serving loop
also checks a flag the handler sets.

Garbage: a host freezes what it inherits from its worker when it starts,
and after each task collects the young garbage the task left and freezes
what survives (``gc.freeze``), so Python's collector never walks the state's
millions of objects in a later batch: at 5M keys per host, a full collection
paused whichever batch it fell in. Objects are still freed when
their last reference goes; only cyclic garbage that aged during a task, or
among frozen objects, waits for the full collection a host runs once every
``policy.FULL_COLLECTION_TASKS`` tasks. A worker freezes its own objects (PySpark,
pyarrow, pandas: most of its heap) at its first task for a host and before
each fork (``process.freeze_worker``, as Python's documentation advises before a fork
without exec): its collector no longer walks them. Those walks cost each
worker CPU in every task and dirtied the pages it shares with the
hosts it forked (each first write copies the page).

The modules, each one job: ``wire`` (frames), ``trust`` (the private
directory, the key, the handshake), ``naming`` (where a host listens),
``tasks`` (a task as it crosses, and a host running it), ``listening`` (a
host's socket and files), ``policy`` (when a host leaves, its garbage),
``adoption`` (adoption and spares), ``serving`` (a host's loop), ``process``
(fork, reap, start-up), ``worker`` (``run_hosted``). May import:
``spark_state.errors``, ``storage``, ``store``, ``executor``; pyspark's
``cloudpickle``, ``Broadcast`` and ``TaskContext`` only.

Trust: sockets, locks and logs live in the executor's private directory,
and both ends of a connection prove they belong to the executor before
anything is unpickled (``trust``). No pyspark, except its bundled
``cloudpickle`` for user functions, its ``Broadcast`` for the broadcast
variables they read (``tasks.pickled_task``) and its ``TaskContext``, which a
host sets to its worker's for each task (``tasks.task_context``).
"""
