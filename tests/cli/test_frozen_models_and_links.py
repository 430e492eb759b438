"""A frozen model and what the run writes, with HFExport's places and link (``<dirpath>.runs/<run>/``,
``dirpath`` a link to the latest): the link is what the run writes, not the model it names now."""

from __future__ import annotations

import os

import pytest
from jsonargparse import Namespace

from lit_offpolicy.cli.preflight import check_frozen_models_are_not_written


@pytest.fixture
def outputs(tmp_path):
    """``outputs/actor.runs/demo`` and ``outputs/actor``, a link to it, as the demo leaves them."""
    (tmp_path / "actor.runs" / "demo").mkdir(parents=True)
    (tmp_path / "actor").symlink_to("actor.runs/demo")
    return tmp_path


def teacher(path) -> Namespace:
    return Namespace(model=Namespace(init_args=Namespace(distill=Namespace(teacher_path=str(path)))))


@pytest.mark.parametrize(
    ("read", "written", "refused"),
    [
        ("actor", "actor", True),  # the link: the run points it at its own model
        ("actor.runs/demo", "actor", False),  # the demo's place: an unnamed run writes another
        ("actor.runs/demo", "actor.runs/demo", True),  # a run named demo writes it
        ("actor", "actor.runs/demo", True),  # the link names what that run writes
        ("actor.runs", "actor.runs/demo", True),  # below the model read
    ],
)
def test_a_frozen_model_is_refused_where_the_run_writes_it_or_its_link(outputs, read, written, refused):
    config, target = teacher(outputs / read), str(outputs / written)
    if refused:
        with pytest.raises(ValueError, match="is written by this same run"):
            check_frozen_models_are_not_written(config, [("HFExport.dirpath", target)])
    else:
        check_frozen_models_are_not_written(config, [("HFExport.dirpath", target)])
    assert os.path.islink(outputs / "actor")
