"""What a run reads and where it saves, checked before anything is built (``lit_offpolicy.cli.preflight``,
issue #47): a model directory named anywhere in the config (a judge, a teacher, a reference) is local
and named by its option when missing, never looked up on the Hub; a judge's server answers at start-up;
a frozen model is not read from a directory the run writes; a new run sets an earlier run's
checkpoints aside, while ``--ckpt_path last`` still resumes; ``configs/distill.yaml`` keeps its teacher;
a reward option given in the wrong place points to the right one; ``limits_only`` says what it is."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, subprocess_env
from helpers.cli_runs import fit_fails_with_one_line, rl_callbacks, small_fit_args

from lit_offpolicy.cli import main
from lit_offpolicy.models import create_tiny_model
from lit_offpolicy.rewards import CodeExecutionReward, JudgeReward

LIT_OFFPOLICY = Path(sys.executable).with_name("lit-offpolicy")
UNROUTABLE_HUB = "http://10.255.255.1"
"""An ``HF_ENDPOINT`` no request can reach: a run that tried the Hub would name it, or hang on it."""
LOADING = "Loading weights"
"""What transformers prints while it loads a model's weights."""


@pytest.fixture
def cli_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.delenv("LIT_OFFPOLICY_TRACEBACK", raising=False)


def grpo(model_dir: str, *options: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--model.init_args.model_path",
        model_dir,
        *options,
    ]


def with_judge(**init_args) -> list[str]:
    """``--rollout.reward.*`` options: the exact reward plus a ``JudgeReward``, scored in-process."""
    judge = {"class_path": "lit_offpolicy.rewards.JudgeReward", "init_args": init_args}
    return ["--rollout.reward.fn", json.dumps(["exact", judge]), "--rollout.reward.timeout", "null"]


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_missing_judge_directory_is_one_line_before_the_model_loads_and_never_the_hub(
    tiny_model_dir, tmp_path
):
    """The console script, with the Hub's address unroutable: one line naming the option, in seconds.
    It was 53 s of retries against huggingface.co and 139 lines ending in an ``OSError``, after the
    policy model had loaded."""
    command = [str(LIT_OFFPOLICY), *grpo(tiny_model_dir, *with_judge(model_path="judges/missing"))]
    started = time.monotonic()
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=subprocess_env(HF_ENDPOINT=UNROUTABLE_HUB),
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("lit-offpolicy: error:")]
    assert error.startswith(
        "lit-offpolicy: error: JudgeReward.model_path: model directory judges/missing does not exist; "
    )
    assert "nothing is downloaded" in error
    assert "Traceback" not in output and LOADING not in output
    assert "10.255.255.1" not in output and "huggingface.co" not in output
    assert seconds < 60, seconds  # the interpreter's start-up and the parse; no network timeout


def test_a_judge_url_that_does_not_answer_is_one_line_before_the_model_loads(
    tiny_model_dir, cli_argv, capsys
):
    """It was a 132-line ``requests`` traceback at the first step, after the model had loaded."""
    url = f"http://127.0.0.1:{closed_port()}"
    error = fit_fails_with_one_line(grpo(tiny_model_dir, *with_judge(url=url)), capsys, alone=True)
    assert error == (
        f"lit-offpolicy: error: JudgeReward.url={url}: no OpenAI-compatible server answered {url}/v1/models "
        "([Errno 111] Connection refused); start the judge's server before the run "
        "(e.g. `python -m lit_offpolicy.rollout.server.serve --model DIR --port 8000`) or correct the url"
    )


class ModelList(BaseHTTPRequestHandler):
    """``GET /v1/models`` lists one model, ``served``; any other path is 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"object": "list", "data": [{"id": "served", "object": "model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def model_list_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ModelList)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_judge_server_is_asked_for_its_models_when_the_judge_is_built(model_list_server):
    """The probe takes the first listed model, refuses one the server does not list, and names an answer
    that is not a model list (a 404: not an OpenAI-compatible server, or a path below it)."""
    assert JudgeReward(url=model_list_server).server_model == "served"
    with pytest.raises(ValueError, match=r"JudgeReward.server_model='other' is not served at .*'served'$"):
        JudgeReward(url=model_list_server, server_model="other")
    with pytest.raises(ValueError, match=r"answered .*/v1/v1/models \(HTTP 404\)"):
        JudgeReward(url=f"{model_list_server}/v1")


@pytest.mark.parametrize(
    "option",
    ["model.init_args.distill.teacher_path", "model.init_args.reference_path"],
)
def test_a_missing_frozen_model_is_named_by_its_option(option, tiny_model_dir, tmp_path, cli_argv, capsys):
    """It was "model directory ... does not exist" without the option, after the actor had loaded."""
    missing = str(tmp_path / "missing")
    error = fit_fails_with_one_line(grpo(tiny_model_dir, f"--{option}", missing), capsys, alone=True)
    assert error.startswith(f"lit-offpolicy: error: {option}: model directory {missing} does not exist; ")
    assert LOADING not in capsys.readouterr().err


def frozen_model_written_by_the_run(case: str, frozen: str, out: Path) -> list[str]:
    """Options that read a frozen model from ``frozen`` while a callback of the run writes there."""
    callbacks = rl_callbacks(out)
    writer = "HFExport" if case == "teacher" else "ModelCheckpoint"
    (callback,) = [c for c in callbacks if c["class_path"].endswith(writer)]
    callback["init_args"]["dirpath"] = frozen
    if case == "teacher":
        return [
            "--trainer.callbacks",
            json.dumps(callbacks),
            "--model.init_args.distill.teacher_path",
            frozen,
        ]
    (rollout,) = [c for c in callbacks if c["class_path"].endswith("Rollout")]
    judge = {"class_path": "lit_offpolicy.rewards.JudgeReward", "init_args": {"model_path": frozen}}
    rollout["init_args"]["reward"] = {"fn": ["exact", judge], "timeout": None}
    return ["--trainer.callbacks", json.dumps(callbacks)]


@pytest.mark.parametrize(
    ("case", "read", "written"),
    [
        ("teacher", "model.init_args.distill.teacher_path", "HFExport.dirpath"),
        ("judge", "JudgeReward.model_path", "ModelCheckpoint.dirpath"),
    ],
)
def test_a_frozen_model_the_run_writes_is_refused_naming_both_options(
    case, read, written, tiny_model_dir, tmp_path, cli_argv, capsys
):
    """A teacher the run exports its student over (configs/distill.yaml did: after one run the teacher
    was the last student), a judge the run checkpoints into: refused before anything loads."""
    frozen = str(create_tiny_model(tmp_path / "frozen", seed=1))
    capsys.readouterr()  # the writing's progress bar
    options = frozen_model_written_by_the_run(case, frozen, tmp_path)
    args = [*grpo(tiny_model_dir, *options), "--trainer.max_steps", "1", "--data.batch_size", "4"]
    error = fit_fails_with_one_line([*args, "--data.num_val_samples", "8"], capsys, alone=True)
    assert error.startswith(
        f"lit-offpolicy: error: {read}={frozen} is written by this same run ({written}={frozen})"
    )


def file_digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.mark.slow
def test_the_distill_config_exports_its_student_beside_its_teacher(tmp_path, monkeypatch, cli_argv):
    """``lit-offpolicy fit --config configs/distill.yaml`` as its header says, from the demo's outputs:
    the teacher (the demo's place, outputs/actor.runs/demo, which outputs/actor links to) is left as it
    was, the student goes to outputs/distill/."""
    monkeypatch.chdir(tmp_path)
    create_tiny_model("outputs/sft-tiny", seed=0)
    teacher = create_tiny_model("outputs/actor.runs/demo", seed=1)
    Path("outputs/actor").symlink_to("actor.runs/demo")
    before = file_digests(teacher)
    small = ["--trainer.max_steps", "1", "--data.batch_size", "4", "--data.num_val_samples", "8"]
    main(["fit", "--config", str(CONFIGS / "distill.yaml"), *small, "--trainer.enable_progress_bar", "false"])
    assert file_digests(teacher) == before
    assert (tmp_path / "outputs" / "distill" / "actor" / "model.safetensors").is_file()
    assert (tmp_path / "outputs" / "distill" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "outputs" / "checkpoints").exists()


@pytest.mark.slow
def test_a_new_run_sets_an_earlier_run_s_checkpoints_aside_and_resume_still_works(
    tiny_model_dir, tmp_path, cli_argv, capsys
):
    """Runs that shared a checkpoint directory piled up last-v1...last-v3.ckpt, and one's save on a signal
    overwrote another's last.ckpt. Now a new run moves the earlier run's checkpoints beside the directory,
    untouched, and says where; ``--ckpt_path last`` resumes and saves over the same last.ckpt."""

    def args(steps: int) -> list[str]:
        return small_fit_args("grpo", tiny_model_dir, tmp_path, steps, rl_callbacks(tmp_path))

    main(args(1))
    checkpoints = tmp_path / "checkpoints"
    first = file_digests(checkpoints)
    capsys.readouterr()
    main(args(2))
    moved = [line for line in capsys.readouterr().err.splitlines() if "earlier run" in line]
    (aside,) = tmp_path.glob("checkpoints.earlier-*")
    assert moved == [
        f"lit-offpolicy: {checkpoints} held an earlier run's 1 checkpoint(s), moved to {aside} (resume that "
        f"run with --ckpt_path {aside / 'last.ckpt'}; --ckpt_path last resumes the run in the directory "
        "instead of starting anew)"
    ]
    assert file_digests(aside) == first  # the earlier run's, as it left them
    assert sorted(path.name for path in checkpoints.iterdir()) == ["last.ckpt"]  # no last-v1.ckpt
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 2
    main([*args(3), "--ckpt_path", "last"])
    assert "earlier run" not in capsys.readouterr().err  # a resumed run moves nothing
    assert sorted(path.name for path in checkpoints.iterdir()) == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 3


@pytest.mark.slow
def test_a_run_refused_at_start_up_moves_nothing_and_the_runs_set_aside_are_bounded(
    tiny_model_dir, tmp_path, cli_argv, capsys
):
    """A new run refused by a check at start-up (``update.sequence_parallel`` 3 on 2 ranks) has moved no
    checkpoint; of the earlier runs' checkpoints set aside, ``--keep_earlier_checkpoints`` (3) newest
    stay, and the run says which went and how to keep more."""

    def args(steps: int) -> list[str]:
        return small_fit_args("grpo", tiny_model_dir, tmp_path, steps, rl_callbacks(tmp_path))

    checkpoints = tmp_path / "checkpoints"
    main(args(1))
    before = file_digests(checkpoints)
    refused = [*args(1), "--trainer.devices", "2", "--model.init_args.update.sequence_parallel", "3"]
    assert "does not divide the 2 trainer ranks" in fit_fails_with_one_line(refused, capsys)
    assert file_digests(checkpoints) == before and not list(tmp_path.glob("checkpoints.earlier-*"))
    for second in range(3):  # earlier runs' checkpoints set aside before
        (tmp_path / f"checkpoints.earlier-20200101-00000{second}").mkdir()
    main([*args(1), "--keep_earlier_checkpoints", "2"])
    kept = sorted(path.name for path in tmp_path.glob("checkpoints.earlier-*"))
    assert kept[0] == "checkpoints.earlier-20200101-000002" and len(kept) == 2
    assert file_digests(tmp_path / kept[1]) == before, "the run just set aside stays"
    removed = [line for line in capsys.readouterr().err.splitlines() if "older run(s)' checkpoints" in line]
    assert removed == [
        "lit-offpolicy: removed 2 older run(s)' checkpoints (checkpoints.earlier-20200101-000000, "
        "checkpoints.earlier-20200101-000001): the 2 newest set aside stay (--keep_earlier_checkpoints N "
        "keeps N; 0 keeps all)"
    ]


def test_a_reward_option_given_to_the_reward_points_to_the_function_s_init_args(cli_argv, capsys):
    """``isolation`` is ``CodeExecutionReward``'s: ``--rollout.reward.isolation`` is refused naming where
    it goes, and that spelling parses; a near miss of the reward's own option is named."""
    code = json.dumps({"class_path": "lit_offpolicy.rewards.CodeExecutionReward"})
    base = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--rollout.reward.fn", code]
    error = fit_fails_with_one_line([*base, "--rollout.reward.isolation", "limits_only"], capsys, alone=True)
    assert "Group 'reward' does not accept option 'isolation'" in error
    assert (
        "reward.fn.init_args.isolation (on the command line: --rollout.reward.fn.init_args.isolation" in error
    )
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--rollout.reward.fn.init_args.isolation", "limits_only", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "isolation: limits_only" in capsys.readouterr().out
    error = fit_fails_with_one_line([*base, "--rollout.reward.timout", "5"], capsys, alone=True)
    assert "does not accept option 'timout'; did you mean reward.timeout?" in error


def test_limits_only_says_at_start_up_that_it_is_no_security_boundary(caplog):
    with caplog.at_level(logging.WARNING):
        CodeExecutionReward(isolation="limits_only")
    (record,) = caplog.records
    assert "\n" not in record.getMessage()
    assert record.getMessage().startswith(
        "lit-offpolicy: warning: CodeExecutionReward isolation: limits_only:"
    )
    assert "no security boundary" in record.getMessage()


def test_the_rl_config_run_before_its_warm_up_names_the_config_that_makes_its_model(
    tmp_path, monkeypatch, capsys
):
    """The README's RL command before the SFT warm-up: the missing outputs/sft-tiny is named with the
    command that exports it (the generic advice alone led a new user to create an untrained model there)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(CONFIGS)
    error = fit_fails_with_one_line(["fit", "--config", "configs/topr.yaml"], capsys, alone=True)
    assert error.endswith(
        "outputs/sft-tiny is what `lit-offpolicy fit --config configs/sft_tiny.yaml` exports: run that first"
    ), error
