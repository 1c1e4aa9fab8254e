"""The fault campaign: randomized faults against keyed queries, checked against a plain Python model.

Run it with ``./run campaign --cycles N --seed S`` (see ``supervisor``).
"""
