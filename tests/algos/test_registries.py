"""Every config-selectable name lives in one table, and every table is documented."""

from pathlib import Path

import pytest

from actloop.algos import REGISTRIES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()


@pytest.mark.parametrize("table", sorted(REGISTRIES))
def test_every_registry_name_is_documented(table):
    for name in REGISTRIES[table]:
        assert f"`{name}`" in DOC, f"{table}: {name!r} is missing from docs/algorithms.md"


@pytest.mark.parametrize("table", sorted(REGISTRIES))
def test_entries_are_callable(table):
    for name, entry in REGISTRIES[table].items():
        assert callable(getattr(entry, "fn", entry)), (table, name)


def test_expected_names():
    assert set(REGISTRIES["loss_agg"]) == {"seq_mean", "token_mean", "constant"}
    assert set(REGISTRIES["policy_loss"]) == {"ppo_clip", "gspo"}
    assert set(REGISTRIES["is_correction"]) == {"none", "tis_token", "tis_seq", "mis_token", "mis_seq"}
    assert set(REGISTRIES["dpo_loss"]) == {"sigmoid", "ipo"}
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "turn_grpo"} <= set(REGISTRIES["advantage"])
