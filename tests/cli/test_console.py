"""The quiet console: messages a user cannot act on are dropped where they are made, others pass."""

import logging

from lit_offpolicy.cli.console import OneLineModelSummary, quiet_lightning


def test_lines_that_say_nothing_to_act_on_are_dropped(caplog):
    quiet_lightning()
    caplog.set_level(logging.INFO)
    resume = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    resume.info("`weights_only` was not set, defaulting to `False`.")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator")
    resume.info("Restored all states from the checkpoint")
    assert [record.getMessage() for record in caplog.records] == ["Restored all states from the checkpoint"]


def test_the_model_summary_is_one_line(caplog):
    caplog.set_level(logging.INFO)
    columns = [(" ", ["0", "1"]), ("Name", ["actor", "reference"]), ("Type", ["Llama", "Llama"])]
    OneLineModelSummary.summarize(columns, 2_200_000, 1_100_000, 8.6, {"train": 59, "eval": 59}, 0)
    (record,) = caplog.records
    expected = "model: actor Llama, reference Llama (1.1 M parameters trained, 1.1 M frozen)"
    assert record.getMessage() == expected
