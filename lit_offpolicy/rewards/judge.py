"""``JudgeReward``: a language model reads each completion and its answer is parsed into a score.

The judge is a local Hugging Face causal-LM directory (run here, greedy; read from local files only,
never downloaded) or an OpenAI-compatible completions server (``vllm serve``, a rollout server), asked
for its models when the judge is built, at start-up. For each completion, ``template`` is filled
with ``{prompt}``, ``{completion}`` and the row's columns (``{answer}``...); the judge continues the
text; ``parser`` turns its answer into a number (a regular expression's first group, or a function by
import path), times ``scale``. An answer that does not parse gives None (the reward does not apply to
that sample) and is counted in ``reward/judge_unparsed_fraction``.
"""

from __future__ import annotations

import importlib
import re
import string
import time
from collections.abc import Callable
from typing import Any

import requests

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.messages import one_line
from lit_offpolicy.rewards.contract import RewardContractError, RewardOutput, completion_text
from lit_offpolicy.rewards.verifiers import REWARDS

DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\nQuestion: {prompt}\nResponse: {completion}\nRating:"
)
NUMBER = r"(-?\d+(?:\.\d+)?)"
IMPORT_PATH = re.compile(r"^[\w.]+:\w+$")
PROBE_TIMEOUT_S = 10.0
"""The most seconds the start-up request to a judge server may take."""


@REWARDS.register("judge")
class JudgeReward:
    """A language model as judge; see the module.

    Args:
        model_path: a local causal-LM directory (with its tokenizer); or
        url: an OpenAI-compatible server's base URL (``http://host:port``), asked ``/v1/completions``;
            it must answer ``/v1/models`` when the judge is built.
        template: the judge's prompt: ``{prompt}``, ``{completion}`` and the row's columns.
        parser: a regular expression (its first group, else the whole match, is the number) or
            ``"pkg.module:function"`` (text -> float or None).
        scale: the score is the parsed number times this (0.1 maps a 0-10 rating to 0-1).
        max_new_tokens: the length of the judge's answer.
        batch_size: texts per generate call (local) or per request (server).
        timeout_s: seconds a batch may take: generation stops there (local) or the request fails (server).
        device: where a local judge runs (None: ``cuda`` where there is one, else ``cpu``).
        server_model: the model name a server is asked for, one it lists (None: the first it lists).
    """

    def __init__(
        self,
        model_path: str | None = None,
        url: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        parser: str = NUMBER,
        scale: float = 1.0,
        max_new_tokens: int = 16,
        batch_size: int = 8,
        timeout_s: float = 60.0,
        device: str | None = None,
        server_model: str | None = None,
    ) -> None:
        if (model_path is None) == (url is None):
            raise ValueError(
                "JudgeReward needs one judge: model_path (a local model directory) or url (a server)"
            )
        if model_path is not None:
            from lit_offpolicy.models import require_model_dir

            require_model_dir(model_path, "JudgeReward.model_path")
        self.model_path, self.url = model_path, url.rstrip("/") if url else None
        self.template = template
        self.fields = [name for _, name, _, _ in string.Formatter().parse(template) if name]
        self.parse = _parser(parser)
        self.parser = parser
        self.scale = float(scale)
        self.max_new_tokens = check_range("max_new_tokens", max_new_tokens, low=1)
        self.batch_size = check_range("batch_size", batch_size, low=1)
        self.timeout_s = check_range("timeout_s", timeout_s, low=0.0, low_inclusive=False)
        self.device, self.server_model = device, server_model
        self._model = self._tokenizer = None
        if self.url is not None:
            self._probe()

    @property
    def fork_safe(self) -> bool:
        """A local judge runs torch, which a forked reward worker cannot (``RewardConfig`` refuses it)."""
        return self.url is not None

    def __call__(self, prompts: list, completions: list, **columns: list) -> RewardOutput:
        texts = [self.render(prompts, completions, columns, i) for i in range(len(completions))]
        answers: list[str] = []
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start : start + self.batch_size]
            answers += self._ask_server(batch) if self.url else self._generate(batch)
        values = [self.parse(answer) for answer in answers]
        scores = [None if value is None else value * self.scale for value in values]
        unparsed = sum(value is None for value in values)
        return RewardOutput(scores, 0, counts={"judge_unparsed": unparsed})

    def render(self, prompts: list, completions: list, columns: dict[str, list], index: int) -> str:
        """The judge's prompt for completion ``index``; a field the row lacks breaks the contract."""
        row = {name: values[index] for name, values in columns.items()}
        row["prompt"] = _text(prompts[index])
        row["completion"] = completion_text(completions[index])
        missing = [name for name in self.fields if name not in row]
        if missing:
            raise RewardContractError(
                f"JudgeReward.template names {{{missing[0]}}}, which the data row does not have; it has "
                f"{', '.join(sorted(row))}"
            )
        return self.template.format(**row)

    def _generate(self, texts: list[str]) -> list[str]:
        """Greedy continuations by the local judge, left-padded in one batch, stopped at ``timeout_s``."""
        import torch

        model, tokenizer = self._load()
        encoded = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad():
            output = model.generate(
                **encoded,
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                max_time=self.timeout_s,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = output[:, encoded["input_ids"].shape[1] :]
        return tokenizer.batch_decode(new, skip_special_tokens=True)

    def _load(self) -> tuple[Any, Any]:
        """The judge and its tokenizer (left-padded), from local files only, in their saved dtype."""
        if self._model is None:
            import torch

            from lit_offpolicy.models import load_reference, load_tokenizer

            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self._tokenizer = load_tokenizer(self.model_path)
            self._tokenizer.padding_side = "left"
            self._model = load_reference(self.model_path, dtype="auto").to(device)
        return self._model, self._tokenizer

    def _probe(self) -> None:
        """Ask the server for the models it serves, so that a URL that does not answer (or not as an
        OpenAI-compatible server) stops the run at start-up in one line; ``server_model`` defaults to
        the first listed."""
        try:
            listed = requests.get(f"{self.url}/v1/models", timeout=min(self.timeout_s, PROBE_TIMEOUT_S))
            listed.raise_for_status()
            served = [entry["id"] for entry in listed.json()["data"]]
        except (requests.RequestException, ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"JudgeReward.url={self.url}: no OpenAI-compatible server answered {self.url}/v1/models "
                f"({_probe_failure(error)}); start the judge's server before the run (e.g. "
                "`python -m lit_offpolicy.rollout.server.serve --model DIR --port 8000`) or correct the url"
            ) from None
        if self.server_model is None and served:
            self.server_model = served[0]
        if self.server_model not in served:
            allowed = ", ".join(repr(name) for name in served) or "none"
            raise ValueError(
                f"JudgeReward.server_model={self.server_model!r} is not served at {self.url}; "
                f"allowed values: {allowed}"
            )

    def _ask_server(self, texts: list[str]) -> list[str]:
        """One ``/v1/completions`` request for the batch, greedy; the answers in the prompts' order."""
        deadline = time.monotonic() + self.timeout_s
        body = {
            "model": self.server_model,
            "prompt": texts,
            "max_tokens": self.max_new_tokens,
            "temperature": 0.0,
        }
        reply = requests.post(
            f"{self.url}/v1/completions", json=body, timeout=max(deadline - time.monotonic(), 1.0)
        )
        reply.raise_for_status()
        choices = sorted(reply.json()["choices"], key=lambda choice: choice["index"])
        return [choice["text"] for choice in choices]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None, "_tokenizer": None}


def _parser(spec: str) -> Callable[[str], float | None]:
    """The answer-to-number function ``spec`` names (see ``JudgeReward``'s ``parser``)."""
    if IMPORT_PATH.match(spec):
        module, name = spec.split(":")
        try:
            function = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"JudgeReward.parser={spec!r} does not import: {error}") from None
        return lambda text: _number(function(text))
    try:
        pattern = re.compile(spec)
    except re.error as error:
        raise ValueError(
            f"JudgeReward.parser={spec!r} is neither a regular expression ({error}) nor pkg.module:function"
        ) from None

    def parse(text: str) -> float | None:
        match = pattern.search(text)
        if match is None:
            return None
        return _number(match.group(1) if pattern.groups else match.group(0))

    return parse


def _probe_failure(error: Exception) -> str:
    """Why the server probe failed, in a few words: the socket's error, the timeout, the HTTP status."""
    if isinstance(error, requests.Timeout):
        return "no answer in time"
    if isinstance(error, requests.ConnectionError):
        socket_error = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
        return socket_error.group(0) if socket_error else one_line(error, limit=160)
    if isinstance(error, requests.HTTPError):
        return f"HTTP {error.response.status_code}"
    return f"the reply is not a model list: {one_line(error, limit=80)}"


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def _text(prompt: Any) -> str:
    """A prompt as text: a string as it is, chat messages' contents one per line."""
    if isinstance(prompt, list):
        return "\n".join(str(message.get("content", "")) for message in prompt)
    return str(prompt)
