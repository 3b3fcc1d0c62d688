"""`resolve_model` on what users pass as --model: a directory that is not a model says what it is."""

import pytest

from actloop.models.resolve import ModelError, resolve_model


def test_a_run_that_kept_no_final_model_says_so(tmp_path):
    run = tmp_path / "scratch"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  save_final: false\n")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ModelError, match=r"is a training run that kept no final model .*train.save_final=false"):
        resolve_model(str(run))


def test_a_directory_without_a_model_is_not_taken_for_one(tmp_path):
    with pytest.raises(ModelError, match="holds no config.json; is it a model directory"):
        resolve_model(str(tmp_path))
