"""The OpenAI-compatible HTTP endpoint that agents call during rollouts.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, served from threads of a
``ThreadingHTTPServer``; every call is authorized by its episode's key, planned on the episode's
``Transcript`` (token in, token out), queued for the engine (``GenerationQueue``) and recorded.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jinja2 import TemplateError

from lit_offpolicy.rollout.agents.batching import GenerationQueue
from lit_offpolicy.rollout.agents.openai_api import (
    CHAT_PARAMETERS,
    COMPLETION_PARAMETERS,
    APIError,
    assistant_message,
    chat_response,
    completion_response,
    sampling_for,
)
from lit_offpolicy.rollout.agents.transcript import BudgetError, Transcript, chat_key, message_text
from lit_offpolicy.rollout.engine import SamplingParams

MAX_BODY_BYTES = 16 * 2**20


@dataclass
class Session:
    """One episode as the endpoint sees it: its key, its transcript and what it was allowed."""

    key: str
    transcript: Transcript
    sampling: SamplingParams
    """The run's sampling for this rollout (greedy in validation)."""
    max_call_tokens: int
    max_calls: int
    training: bool = True
    """Samples to train on: a request must sample as the run does (validation: any, greedy)."""
    calls: int = 0
    rejected: int = 0
    """Calls answered with a 4xx error."""
    tool_calls: int = 0
    """Tool calls in the replies."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class AgentEndpoint:
    """Serves the policy to agents; ``open`` a session per episode, ``close`` it when the episode ends.

    Args:
        tokenizer: the actor's (its chat template renders the messages).
        queue: where calls wait for the engine.
        model_name: the one model name served (``/v1/models``); requests for another get a 404.
        host, port: where to listen; port 0 takes a free one.
        timeout_s: the longest a call waits for its generation.
    """

    def __init__(
        self, tokenizer, queue: GenerationQueue, model_name: str, host: str, port: int, timeout_s: float
    ) -> None:
        self.tokenizer = tokenizer
        self.queue = queue
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe to share between threads
        self._server = _Server((host, port), _Handler)
        self._server.endpoint = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v1"

    def open(
        self,
        transcript: Transcript,
        sampling: SamplingParams,
        max_call_tokens: int,
        max_calls: int,
        training: bool = True,
    ) -> Session:
        key = f"sk-episode-{secrets.token_hex(16)}"
        session = Session(key, transcript, sampling, max_call_tokens, max_calls, training)
        with self._lock:
            self.sessions[session.key] = session
        return session

    def close(self, session: Session) -> None:
        """Revoke the session's key: its later calls get a 401."""
        with self._lock:
            self.sessions.pop(session.key, None)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # the routes

    def authorize(self, header: str | None) -> Session:
        key = (header or "").removeprefix("Bearer ").strip()
        with self._lock:
            session = self.sessions.get(key)
        if session is None:
            raise APIError(
                401,
                "invalid API key: each episode has its own, valid while the episode runs",
                code="invalid_api_key",
            )
        return session

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "lit-offpolicy"}],
        }

    def chat(self, session: Session, request: dict) -> dict:
        self._check_model(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
            raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        tools = request.get("tools") or None
        render = request.get("chat_template_kwargs") or {}
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the model's tokenizer has no chat template: use /v1/completions", "messages")
        params = self._begin(session, request, CHAT_PARAMETERS)
        try:
            with self._tokenizer_lock:
                plan = session.transcript.plan_chat(messages, tools, render)
        except BudgetError as error:
            raise APIError(400, str(error), "messages", "context_length_exceeded") from None
        except TemplateError as error:  # a template that raises on a conversation it does not expect
            message = f"the model's chat template cannot render these messages: {error}"
            raise APIError(400, message, "messages") from None
        self._count(session)
        generation, version = self._generate(session, plan, params)
        with self._tokenizer_lock:
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        message, finish = assistant_message(text, parse_tools=bool(tools))
        key = chat_key(messages, tools, message)
        with self._tokenizer_lock:
            session.transcript.record(
                plan, generation, version, "chat", key, message_text(message.get("content")) or text
            )
        session.tool_calls += len(message.get("tool_calls") or ())
        return chat_response(
            self.model_name, message, finish or generation.finish_reason, generation, len(plan.prompt),
            bool(request.get("logprobs")), self.tokenizer,
        )  # fmt: skip

    def completion(self, session: Session, request: dict) -> dict:
        self._check_model(request)
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list, as the client may send it
        is_ids = (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not (isinstance(prompt, str) and prompt) and not is_ids:
            raise APIError(400, "prompt must be one non-empty string or one list of token ids", "prompt")
        params = self._begin(session, request, COMPLETION_PARAMETERS)
        try:
            with self._tokenizer_lock:
                plan = session.transcript.plan_ids(prompt) if is_ids else session.transcript.plan_text(prompt)
        except BudgetError as error:
            raise APIError(400, str(error), "prompt", "context_length_exceeded") from None
        if is_ids and not all(0 <= token < len(self.tokenizer) for token in prompt):
            raise APIError(400, f"token ids must be in [0, {len(self.tokenizer)}): the vocabulary", "prompt")
        self._count(session)
        generation, version = self._generate(session, plan, params)
        with self._tokenizer_lock:
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
            whole = (tuple(plan.prompt + generation.token_ids),) if is_ids else (prompt + text,)
            session.transcript.record(plan, generation, version, "ids" if is_ids else "text", whole, text)
        return completion_response(
            self.model_name, text, generation, len(plan.prompt), bool(request.get("logprobs")), self.tokenizer
        )

    # helpers

    def _check_model(self, request: dict) -> None:
        if request.get("model") != self.model_name:
            raise APIError(
                404,
                f"model {request.get('model')!r} is not served here; this run serves "
                f"{self.model_name!r} (agent.model_name)",
                "model",
                "model_not_found",
            )

    def _begin(self, session: Session, request: dict, allowed: frozenset) -> SamplingParams:
        """The call's sampling; refused (4xx) where a parameter cannot be honoured."""
        return sampling_for(request, session.sampling, session.max_call_tokens, allowed, session.training)

    def _count(self, session: Session) -> None:
        """Count a call that will be generated against ``max_calls`` (refused calls do not count)."""
        with session.lock:
            allowed = session.calls < session.max_calls
            session.calls += allowed
        if not allowed:
            message = f"this episode made its agent.max_calls={session.max_calls} calls"
            raise APIError(429, message, code="max_calls")

    @staticmethod
    def rejected(session: Session, error: APIError) -> None:
        """Count a call of the session answered with a 4xx error (``agent/rejected_calls_mean``)."""
        if error.status < 500:
            with session.lock:
                session.rejected += 1

    def _generate(self, session: Session, plan, params: SamplingParams):
        room = session.transcript.room(plan)
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        try:
            return self.queue.submit(plan.prompt, params).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise APIError(504, f"no generation within agent.timeout_s={self.timeout_s}") from None
        except Exception as error:
            raise APIError(503, f"generation failed: {type(error).__name__}: {error}") from None


def _is_message(message) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str)


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the listen backlog: every episode of a batch may connect at once
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        endpoint: AgentEndpoint = self.server.endpoint  # type: ignore[attr-defined]
        try:
            endpoint.authorize(self.headers.get("Authorization"))
            if self.path.rstrip("/") != "/v1/models":
                raise APIError(404, f"no route {self.path}")
            self._send(200, endpoint.models())
        except APIError as error:
            self._send(error.status, error.body())

    def do_POST(self) -> None:  # noqa: N802
        endpoint: AgentEndpoint = self.server.endpoint  # type: ignore[attr-defined]
        session = None
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(length)
            session = endpoint.authorize(self.headers.get("Authorization"))
            try:
                request = json.loads(raw or b"{}")
            except json.JSONDecodeError as error:
                raise APIError(400, f"the body is not JSON: {error.msg}") from None
            if not isinstance(request, dict):
                raise APIError(400, "the body must be a JSON object")
            route = self.path.rstrip("/")
            if route == "/v1/chat/completions":
                self._send(200, endpoint.chat(session, request))
            elif route == "/v1/completions":
                self._send(200, endpoint.completion(session, request))
            else:
                raise APIError(404, f"no route {self.path}")
        except APIError as error:
            if session is not None:
                endpoint.rejected(session, error)
            self._send(error.status, error.body())
        except Exception as error:  # a bug of ours: the agent sees a 500, the run goes on
            self._send(500, APIError(500, f"{type(error).__name__}: {error}").body())

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the agent gave up on the call
            pass

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the stdlib's name)
        return None
