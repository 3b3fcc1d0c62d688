"""The one table of algorithms: every reader takes its names from it (that the update branches on no
name: tests/train/test_update_learns.py::test_the_update_reads_the_algorithms_row_not_its_name)."""


import pytest

from actloop.algos import ADVANTAGE_ESTIMATORS, ALGORITHMS
from actloop.config import ConfigError, load_config


def test_every_online_algorithm_names_a_known_estimator_and_config_keys():
    cfg = load_config(None, [])
    for name, a in ALGORITHMS.items():
        assert a.loss in ("policy", "preference", "supervised"), name
        if a.online:
            est = ADVANTAGE_ESTIMATORS[a.advantage]
            for k, key in a.params.items():
                obj = cfg
                for part in key.split("."):
                    obj = getattr(obj, part)  # every mapped key exists in the config
            if a.turn_advantage:
                assert ADVANTAGE_ESTIMATORS[a.turn_advantage].level == "token"
            assert est.needs_critic == a.needs_critic
        else:
            assert a.advantage is None and ":" in a.trainer, name


def test_config_accepts_exactly_the_table():
    for name in ALGORITHMS:
        assert load_config(None, [f"algo={name}"]).algo == name
    with pytest.raises(ConfigError, match="algo must be one of"):
        load_config(None, ["algo=trpo"])


def test_turn_credit_refused_for_an_algorithm_without_a_turn_estimator():
    with pytest.raises(ConfigError, match="turn_credit"):
        load_config(None, ["algo=rloo", "train.turn_credit=true"])
    load_config(None, ["algo=grpo", "train.turn_credit=true"])


def test_compare_and_torchrun_read_the_table():
    from actloop.tools.compare import ALGORITHMS as COMPARE
    from actloop.train.runtime.distributed import check_supported

    assert {v[0].split("=")[1] for v in COMPARE.values()} == set(ALGORITHMS)
    for name, a in ALGORITHMS.items():
        if not a.online:
            continue
        cfg = load_config(None, [f"algo={name}", "train.prompts_per_step=2"])
        if a.torchrun:
            check_supported(cfg, 2)
        else:
            with pytest.raises(ConfigError, match=f"algo={name}"):
                check_supported(cfg, 2)


def test_config_show_explains_every_algorithm_where_it_is_chosen():
    """`algo`'s doc (what `config show` prints for it) is built from the table: each row's own doc
    under its name, so a new row is explained where it is chosen."""
    from actloop.config import all_keys

    [doc] = [d for key, _, _, d in all_keys() if key == "algo"]
    for name, a in ALGORITHMS.items():
        assert a.doc and f"`{name}` {a.doc}" in doc, name
