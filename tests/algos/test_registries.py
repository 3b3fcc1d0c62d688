"""Every config-selectable name lives in one table: the config key accepts exactly the table's
names (a name added to the table is selectable at once, one removed is refused with the closest
one), and every entry is callable."""

import pytest

from actloop.algos import REGISTRIES
from actloop.config import ConfigError, get_key, load_config

# table -> the config key that picks from it (advantage: through `algo`'s rows, tests/algos/test_algorithms.py)
KEYS = {"advantage_scale": "train.adv_scale", "loss_agg": "train.loss_agg", "policy_loss": "train.policy_loss",
        "kl_estimator": "kl.estimator", "kl_controller": "kl.controller", "dpo_loss": "dpo.loss",
        "is_correction": "correction.mode"}


def test_every_table_but_the_estimators_has_its_key():
    assert set(KEYS) == set(REGISTRIES) - {"advantage"}


@pytest.mark.parametrize("table", sorted(KEYS))
def test_the_key_accepts_exactly_the_tables_names(table):
    key, names = KEYS[table], list(REGISTRIES[table])
    for name in names:
        assert get_key(load_config(None, [f"{key}={name}"]), key) == name
    typo = names[-1] + "x"
    with pytest.raises(ConfigError, match=f"{key} must be one of .*{names[0]}.*; got `{typo}`"):
        load_config(None, [f"{key}={typo}"])


def test_a_name_added_to_a_table_is_selectable_and_a_removed_one_refused(monkeypatch):
    policy = REGISTRIES["policy_loss"]
    monkeypatch.setitem(policy, "my_loss", policy["ppo_clip"])
    assert load_config(None, ["train.policy_loss=my_loss"]).train.policy_loss == "my_loss"
    monkeypatch.delitem(policy, "gspo")
    with pytest.raises(ConfigError, match="got `gspo`"):
        load_config(None, ["train.policy_loss=gspo"])


@pytest.mark.parametrize("table", sorted(REGISTRIES))
def test_entries_are_callable(table):
    for name, entry in REGISTRIES[table].items():
        assert callable(getattr(entry, "fn", entry)), (table, name)
