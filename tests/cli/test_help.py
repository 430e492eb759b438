"""What the command offers: fit alone of Lightning's subcommands, and the option groups' field
docstrings read for the commands that print descriptions, and only for them (reading them parses the
classes' source at each start-up)."""

import jsonargparse
import pytest

from lit_offpolicy.cli import main
from lit_offpolicy.cli.command import prints_descriptions


@pytest.mark.parametrize(
    "command",
    [
        ["fit", "--help"],
        ["fit", "-h"],
        ["fit", "--model.help", "lit_offpolicy.module.OffPolicyModule"],
        ["fit", "--trainer.callbacks.help=Rollout"],
        ["fit", "--config", "c.yaml", "--trainer.max_steps", "x", "--help"],
    ],
)
def test_commands_that_print_descriptions(command):
    assert prints_descriptions(command)


@pytest.mark.parametrize(
    "command",
    [
        ["fit", "--config", "configs/grpo.yaml"],
        ["fit", "--config", "c.yaml", "--print_config"],
        ["fit", "--config", "c.yaml", "--print_config=skip_default"],
        ["fit", "--model.init_args.optim.lr", "1e-6", "--trainer.default_root_dir", "helpers"],
    ],
)
def test_commands_that_do_not(command):
    assert not prints_descriptions(command)


def test_a_groups_field_docstring_is_in_the_class_help_and_off_for_the_next_command(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--model.help", "lit_offpolicy.module.OffPolicyModule"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model.optim.lr LR The actor's learning rate." in text, text[:2000]
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.max_steps", "not-a-number"])
    assert jsonargparse._optionals.get_docstring_parse_options()["attribute_docstrings"] is False


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_lightnings_other_subcommands_are_one_line_not_a_traceback(subcommand, capsys):
    """No module here has a validation, test or predict step: Lightning's traceback was all they gave."""
    with pytest.raises(SystemExit) as stop:
        main([subcommand, "--trainer.max_steps", "1"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"invalid choice: '{subcommand}' (choose from 'fit')" in line, line
