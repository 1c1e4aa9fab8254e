"""A short seeded run of the fault campaign (``tests/campaign``): every cycle's output exact, nothing hangs.

The committed long run is ``benchmarks/results/campaign.json`` (``./run campaign --cycles 200 --seed ...``).
"""

from __future__ import annotations

import pytest

from tests.campaign.supervisor import Campaign

KINDS = ["kill_after_manifest", "truncate", "delete_newest_record", "kill_worker", "drain"]


@pytest.mark.spark
def test_a_short_seeded_campaign_finds_every_batch_and_the_final_state_exact(tmp_path):
    campaign = Campaign(tmp_path, seed=20261123, cycles=len(KINDS), cycle_timeout=300, cluster_cycles=False,
                        max_parallelism=3, shapes=("timers",), kinds=KINDS)
    summary = campaign.run()
    assert summary["problems"] == []
    assert {k: summary[k] for k in ("wrong", "lost", "duplicated", "hangs", "untyped_faults")} == dict.fromkeys(
        ("wrong", "lost", "duplicated", "hangs", "untyped_faults"), 0)
    assert summary["cycles"] == len(KINDS) + 1 and summary["states_checked"] == 1
    assert summary["batches_checked"] >= len(KINDS) and sum(summary["faults"].values()) >= 3


def test_a_resumed_run_takes_the_appends_of_an_interrupted_cycle_into_its_record(tmp_path):
    campaign = Campaign(tmp_path, seed=3, cycles=4, cycle_timeout=60, cluster_cycles=False)
    campaign.events.append(50)
    campaign.save()
    campaign.events.append(30)  # the next cycle appended, then the run was stopped before it saved
    resumed = Campaign.resume(tmp_path)
    assert sum(resumed.events.end_offsets().values()) == 80 and resumed.events.appends == 2
    assert resumed.events.verify() == []
    resumed.events.splits[0][0] = resumed.events.splits[0][1]  # the check can fail
    assert resumed.events.verify() != []
