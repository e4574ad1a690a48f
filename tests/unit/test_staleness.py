"""The staleness rule (lorarl.contract.staleness) and the parts that keep to it agree."""

from __future__ import annotations

import torch

from lorarl.client.job.config import load_job_config
from lorarl.client.launch.services import stack_sections
from lorarl.client.rl.loop import job_config_proto
from lorarl.contract import staleness


def test_a_token_is_fresh_up_to_the_bound_and_stale_beyond_it() -> None:
    assert staleness.fresh(5, 3, bound=2) and not staleness.fresh(5, 2, bound=2)
    assert staleness.fresh(5, torch.tensor([5, 4, 3, 2]), bound=2).tolist() == [True, True, True, False]
    assert staleness.fresh(5, 5, bound=0) and not staleness.fresh(5, 4, bound=0)


def test_admission_keeps_every_admitted_token_fresh() -> None:
    """A batch admitted at served version v trains at version == its index: no token it holds is stale."""
    for bound in range(4):
        for index in range(10):
            for served in range(index + 1):
                if staleness.admits(served, index, bound):
                    assert staleness.fresh(index, served, bound)
                else:
                    assert not staleness.fresh(index, served, bound)


def test_the_loop_and_the_stack_take_their_values_from_the_rule(tmp_path) -> None:
    for bound in (0, 1, 3):
        cfg = load_job_config("examples/demo.yaml", ["loop.mode=async", f"loop.max_staleness={bound}"])
        loss = job_config_proto(cfg, "/models/m").loss
        assert loss.HasField("max_staleness") and loss.max_staleness == bound
        assert stack_sections(cfg, tmp_path)["rollout"]["adapter_window"] == staleness.adapter_window(bound)
    sync = load_job_config("examples/demo.yaml", ["loop.mode=sync"])
    assert not job_config_proto(sync, "/models/m").loss.HasField("max_staleness")
