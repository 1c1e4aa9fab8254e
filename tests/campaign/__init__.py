"""The fault campaign: randomized faults against keyed queries, checked against a plain Python model.

Run it with ``./run campaign --cycles N --seed S`` (``supervisor``). Its parts: ``supervisor`` (the cycles and
every check), ``faults`` (the fault kinds and their injection: **a new fault kind is one entry there**),
``driver`` (the process that runs a query under test), ``events`` (the log the queries read), ``model`` (the
shapes of query and their expected output).
"""
