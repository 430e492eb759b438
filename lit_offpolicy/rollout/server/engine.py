"""A rollout engine on vLLM's own OpenAI-compatible servers, outside the trainer process.

Generation goes to vLLM's token-in/token-out route ``/inference/v1/generate`` (``--enable-scale-out``):
token ids in, token ids out with the log-prob of each sampled token and the weight version that
sampled it, never re-tokenised text. Log-probs follow the in-process ``VLLMEngine``'s convention
(``--logprobs-mode processed_logprobs``: log_softmax(logits / T), see ``rollout.vllm_engine``).

Weights go through vLLM's RL routes (``vllm/entrypoints/rl/``): ``/pause?mode=keep``, then
``/start_weight_update``, ``/update_weights`` per bucket and ``/finish_weight_update`` with the new
version (``transfer``), ``/reset_prefix_cache?reset_running_requests=true`` (requests in flight drop
their KV cache and recompute it under the new weights, so every token is sampled by exactly one
version, the one it is labelled with; without it the tokens after a push attend to keys and values
of the old weights, 0.03 to 0.15 off in log-prob on the tiny model), then ``/resume``.

A trainer of several ranks (docs/rollout_servers.md, "Several trainer ranks"): every rank sends its
own prompts to all the servers; rank 0 alone launches them (the others get their URLs by one
broadcast) and pushes the weights, which every rank streams all the same (the gathers of sharded
parameters are collectives); the ranks agree on the servers lost where they meet
(``callbacks.rollout.saves_last_when_stopped``).

A lost server comes back (``healing``; ``max_restarts``): rank 0's next push admits it, brings it to
the version it pushes, and only then does it take requests again, on every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.core.distributed import barrier, from_rank_zero, gather_objects
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.rollout.engine import (
    ENGINES,
    EngineContext,
    EngineSpec,
    SamplingParams,
    Weights,
    WeightSyncHook,
    check_prompts,
    weight_items,
)
from lit_offpolicy.rollout.server.client import ServerClient, ServerError
from lit_offpolicy.rollout.server.pool import Server, ServerPool, ServersLostError
from lit_offpolicy.rollout.server.process import REQUIRED_OPTIONS, LaunchedServer
from lit_offpolicy.rollout.server.shm_sender import ShmWeightSender
from lit_offpolicy.rollout.server.tcp_sender import TcpWeightSender
from lit_offpolicy.rollout.server.transfer import TRANSFERS, connect_senders
from lit_offpolicy.rollout.vllm_engine import (
    VLLMEngineSpec,
    check_room,
    copy_generation,
    request_seed,
    warn_if_truncated,
)
from lit_offpolicy.rollout.weight_sync import DEFAULT_BUCKET_BYTES, buckets_of

GENERATE_ROUTE = "/inference/v1/generate"
POLL_S = 0.02
"""With partial rollouts: how often a generation in progress looks for newer weights to push."""
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class VLLMServerEngine:
    """Generates on a pool of vLLM servers (``ServerPool``) and pushes the trainer's weights to them.

    Each prompt is one request with its ``n`` samples (a group stays on one server, which serves its
    shared prompt from the prefix cache), sent to the live server with the least outstanding work.

    ``ranks`` > 1: one of several trainer ranks that share the servers. Only ``rank`` 0 pushes
    weights; each token records the version that sampled it (another rank's push can land in the
    middle of this rank's requests). ``connect(servers)``: gives servers that come back their weight
    sender (rank 0).
    """

    remote = True
    """It samples elsewhere: no ``perf/*/generate`` against this process's device."""

    def __init__(
        self,
        pool: ServerPool,
        max_model_len: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        ranks: int = 1,
        rank: int = 0,
        connect: Callable[[list[Server]], None] = lambda servers: None,
    ) -> None:
        self.pool = pool
        self.connect = connect
        self._agreed_states = [ServerPool.state(server) for server in pool.servers]
        """The servers' states the ranks last agreed on (``agree_on_servers``)."""
        self.max_model_len = max_model_len
        self.bucket_bytes = bucket_bytes
        self.pushes = rank == 0
        """Whether this process sends the weights: the only trainer rank, or rank 0 of several."""
        self.records_versions = ranks > 1
        self.policy_version = 0
        self.last_sync_seconds: float | None = None
        self._warned_truncation = False
        self._warned_length = False
        atexit.register(self.close)

    # ----------------------------------------------------------------- generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, sync: WeightSyncHook | None = None
    ) -> list[list[Generation]]:
        """``params.n`` generations per prompt, with each token's log-prob.

        With ``sync`` (partial rollouts): while requests run, newer weights are pushed as soon as they
        are pending (``sync.apply()``, which calls :meth:`load_weights`); the requests go on under
        them, and each token records the version that sampled it (``Generation.versions``).
        """
        if not prompts:
            return []
        check_prompts(prompts)
        if check_room(prompts, params.max_tokens, self.max_model_len, warn=not self._warned_length):
            self._warned_length = True
        if not self._warned_truncation:
            self._warned_truncation = warn_if_truncated(params)
        samples = 1 if params.greedy else params.n
        cost = samples * params.max_tokens
        bodies = [_request_body(prompt, params, index, samples) for index, prompt in enumerate(prompts)]
        with ThreadPoolExecutor(max_workers=min(len(bodies), 256), thread_name_prefix="rollout") as threads:
            futures = [
                threads.submit(self.pool.request, GENERATE_ROUTE, body, cost, unfinished) for body in bodies
            ]
            _wait_pushing(futures, sync)
            answers = [future.result() for future in futures]
        recorded = sync is not None or self.records_versions
        groups = [self._generations(answer, recorded) for answer in answers]
        if params.greedy:  # vLLM refuses n > 1 when greedy: decode once, hand out n copies
            groups = [[copy_generation(group[0]) for _ in range(params.n)] for group in groups]
        return groups

    def _generations(self, answer: dict[str, Any], recorded: bool) -> list[Generation]:
        generations = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            tokens = list(choice["token_ids"])
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(tokens):
                raise RuntimeError("a vLLM server returned no log-prob for some sampled tokens")
            versions = token_versions(choice.get("weight_versions"), len(tokens))
            if not recorded and any(version != self.policy_version for version in versions):
                raise RuntimeError(
                    f"a vLLM server sampled with weights of version {sorted(set(versions))}, but the run "
                    f"pushed {self.policy_version}: was a server restarted, or updated by another run?"
                )
            log_probs = [float(entry["logprob"]) for entry in content]
            generations.append(
                Generation(tokens, log_probs, choice["finish_reason"], versions if recorded else None)
            )
        return generations

    # ----------------------------------------------------------------- weights

    def load_weights(self, weights: Weights, version: int) -> None:
        """Push ``weights`` (Hugging Face names) to every live server and serve them as ``version``.

        Pause (requests in flight are kept), stream the buckets, finish with the version, drop the
        KV cache of the old weights (requests in flight recompute theirs), resume. A server that
        stops answering meanwhile is lost, not fatal, while another is left.

        On a trainer rank other than 0 the weights are streamed to their end (under FSDP2 and ZeRO-3
        each bucket's gather is a collective that rank 0's push waits for) and dropped, and the rank
        waits for the servers to serve ``version``: its requests then sample the weights it was handed,
        as rank 0's do (an async producer would otherwise start its next batch on the old ones)."""
        started = time.perf_counter()
        if not self.pushes:
            for _ in weight_items(weights):
                pass
            self._wait_for_version(version)
            self.last_sync_seconds = time.perf_counter() - started
            self.policy_version = version
            return
        pool = self.pool
        self._admit_ready()
        pool.for_each(
            lambda server: server.client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        )
        try:
            pool.for_each(lambda server: server.client.post("/start_weight_update"))
            for bucket in buckets_of(weight_items(weights), self.bucket_bytes):
                pool.for_each(lambda server, bucket=bucket: server.sender.send_bucket(bucket))
            pool.for_each(
                lambda server: server.client.post("/finish_weight_update", {"weight_version": str(version)})
            )
            pool.for_each(
                lambda server: server.client.post(
                    "/reset_prefix_cache", params={"reset_running_requests": "true"}
                )
            )
        finally:
            pool.for_each(lambda server: server.client.post("/resume"))
        pool.rejoin(version)
        self.last_sync_seconds = time.perf_counter() - started
        self.policy_version = version

    def _admit_ready(self) -> None:
        """The servers that came back join this push, each with a new weight sender; one whose context
        is shorter than the run's is lost."""
        for server in self.pool.admit_ready():
            try:
                if (length := _max_model_len(server.client)) < self.max_model_len:
                    raise ServerError(
                        f"it came back with max_model_len {length} < the run's {self.max_model_len}"
                    )
                self.connect([server])
            except ServerError as error:
                self.pool.lose(server, error)

    def _wait_for_version(self, version: int) -> None:
        """Until every live server serves ``version`` or a later one (``/weight_info``), for at most
        the request time limit. A server that does not answer is not waited for: whether it is lost
        the ranks decide together, where they meet."""
        deadline = time.monotonic() + self.pool.servers[0].client.timeout_s
        waiting = self.pool.alive
        while waiting and time.monotonic() < deadline:
            waiting = [server for server in waiting if _served_version(server) < version]
            if waiting:
                time.sleep(POLL_S)

    # ----------------------------------------------------------------- the rest of the protocol

    @property
    def start_note(self) -> str:
        """The line a run prints at start: the servers, and where the launched ones log."""
        servers = self.pool.servers
        named = ", ".join(server.url + _weights_by(server) for server in servers)
        note = f"rollouts on {len(servers)} vLLM server(s): {named}"
        logs = [str(server.launched.log_file) for server in servers if server.launched is not None]
        return note + (f"; their logs: {', '.join(logs)}" if logs else "")

    @property
    def last_progress(self) -> float:
        """When a server last answered a generation request (``time.monotonic``)."""
        return self.pool.last_answer

    def metrics(self) -> dict[str, float]:
        """``rollout/servers_alive``: the servers that serve; ``rollout/server_restarts``: the servers
        brought back so far."""
        return {
            "rollout/servers_alive": float(len(self.pool.serving)),
            "rollout/server_restarts": float(self.pool.restarts),
        }

    def server_states(self) -> list[int]:
        """Each server's state on this rank (``ServerPool.state``), in the pool's order (every rank's)."""
        return [ServerPool.state(server) for server in self.pool.servers]

    def agree_on_servers(self, states: list[int]) -> None:
        """Take the ranks' ``server_states`` reduced by MAX (the same on every rank): a server lost by one
        rank is lost for all, one that came back serves on all. Rank 0 tells each loss with the reason
        of the first rank that lost it (one ``gather_objects``, where the states changed)."""
        if states == self._agreed_states:
            return
        self._agreed_states = list(states)
        reasons = gather_objects([server.lost_because for server in self.pool.servers])
        for server in self.pool.agree(states):
            index = self.pool.servers.index(server)
            rank, reason = next(
                ((r, why[index]) for r, why in enumerate(reasons) if why[index]), (0, "it is coming back")
            )
            self.pool.lose(server, ServerError(f"trainer rank {rank} lost it: {reason}"))

    def sleep(self) -> None:
        """Nothing to free in the trainer's process: the servers hold their own memory."""

    def wake_up(self) -> None:
        """See :meth:`sleep`."""

    def close(self) -> None:
        """Close the connections and stop the servers the run launched (safe to call more than once)."""
        self.pool.close()


def _weights_by(server: Server) -> str:
    """ " (weights by shared memory)" or " (weights by TCP)": how this process pushes to ``server``."""
    kind = {ShmWeightSender: "shared memory", TcpWeightSender: "TCP"}.get(type(server.sender))
    return f" (weights by {kind})" if kind else ""


def _served_version(server: Server) -> float:
    """The weight version ``server`` serves; infinity where it does not answer or names none of ours."""
    try:
        return int(server.client.get("/weight_info", timeout_s=5.0)["weight_version"])
    except (ServerError, KeyError, TypeError, ValueError):
        return math.inf


def _wait_pushing(futures: list[Future], sync: WeightSyncHook | None) -> None:
    """Wait for ``futures``; with ``sync``, push newer weights as soon as they are pending."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=POLL_S if sync else None, return_when=FIRST_COMPLETED)
        if any(future.exception() is not None for future in done):
            return  # the caller's result() raises it
        if sync is not None and pending and sync.pending():
            sync.apply()


def unfinished(answer: dict[str, Any]) -> str | None:
    """Why a generation answer is a failed request: a response that ended otherwise than ``stop`` or
    ``length`` (``abort``: the server's engine core died, or the request was cancelled), else None."""
    reasons = {choice["finish_reason"] for choice in answer["choices"]} - {"stop", "length"}
    return f"finished a response with reason {sorted(reasons)[0]!r}" if reasons else None


def _request_body(prompt: list[int], params: SamplingParams, index: int, samples: int) -> dict[str, Any]:
    """One ``/inference/v1/generate`` request; every sampling knob is set, none left to defaults."""
    return {
        "token_ids": list(prompt),
        "sampling_params": {
            "n": samples,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": max(params.top_k, 0),
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": params.max_tokens,
            "stop_token_ids": list(params.stop_token_ids),
            "seed": request_seed(params.seed, index),
            "logprobs": 0,
            "detokenize": False,
        },
    }


def token_versions(spans: list[dict[str, Any]] | None, length: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``[start, end)`` labelled ``version``)."""
    versions: list[int | None] = [None] * length
    for span in spans or []:
        try:
            version = int(span["version"])
        except ValueError:
            raise RuntimeError(
                f"a vLLM server labels its weights {span['version']!r}: they were not pushed by this run"
            ) from None
        versions[span["start"] : span["end"]] = [version] * (span["end"] - span["start"])
    if any(version is None for version in versions):
        raise RuntimeError("a vLLM server returned no weight version for some sampled tokens")
    return versions  # type: ignore[return-value]


@ENGINES.register("vllm_server")
@dataclass(frozen=True)
class VLLMServerSpec(EngineSpec):
    """vLLM servers outside the trainer (:class:`VLLMServerEngine`): ones already running (``urls``)
    or ``launch``-ed by the run on this machine, whose life is tied to the run's."""

    partial_rollouts = True

    urls: list[str] = field(default_factory=list)
    """Servers that already run (``http://host:port``), started with the options in
    docs/rollout_servers.md; empty: ``launch``."""
    launch: dict[str, Any] | None = None
    """``{servers: N, ...}``: start N servers on loopback ports; the other keys are
    ``vllm serve`` options (``max_num_seqs: 64``), ``max_model_len`` derived where left out."""
    request_timeout_s: float = 600.0
    """Longest wait for one request (a generation, a weight bucket)."""
    startup_timeout_s: float = 300.0
    """Longest wait for a launched server's ``/health``."""
    transfer: str = "auto"
    """How the weights reach the servers: ``shm`` (shared memory, servers on this host), ``tcp`` (any
    host), ``auto`` (shared memory for launched servers and URLs of this host, else TCP; ``transfer``)."""
    transfer_host: str | None = None
    """The trainer's address as the servers reach it for TCP; None: 127.0.0.1 for servers on
    loopback, else this machine's host name."""
    max_restarts: int = 5
    """A lost server comes back: a launched one is started again (at most this many starts in a row
    that fail), a given URL rejoins once it answers; 0: a lost server stays out of the run."""

    def __post_init__(self) -> None:
        if self.urls and self.launch is not None:
            raise ValueError(
                "engine vllm_server: both urls and launch are set (a config's launch stays when the command "
                "line adds urls); give the whole engine: --rollout.engine '{class_path: "
                "lit_offpolicy.rollout.VLLMServerSpec, init_args: {urls: [http://HOST:PORT]}}'"
            )
        if not self.urls and self.launch is None:
            raise ValueError(
                "engine vllm_server: give urls (servers that run) or launch "
                "({servers: N, ...vllm serve options})"
            )
        if self.launch is not None:
            check_range("launch.servers", self.launch.get("servers", 1), low=1)
            for name, value in REQUIRED_OPTIONS.items():
                if name in self.launch and self.launch[name] != value:
                    raise ValueError(f"launch.{name}: the engine needs {value!r}; leave it out")
        for url in self.urls:
            if urlparse(url).scheme not in ("http", "https") or not urlparse(url).port:
                raise ValueError(f"urls: {url!r} is not http://host:port")
        if self.transfer == "nccl":
            raise ValueError(
                "transfer='nccl' is not shipped (vLLM's NCCL engine needs a GPU on both ends); "
                "allowed values: 'auto', 'shm', 'tcp'"
            )
        check_choice("transfer", self.transfer, TRANSFERS)
        check_range("request_timeout_s", self.request_timeout_s, low=0.0, low_inclusive=False)
        check_range("startup_timeout_s", self.startup_timeout_s, low=0.0, low_inclusive=False)
        check_range("max_restarts", self.max_restarts, low=0)

    def sized(
        self,
        prompt_tokens: int | None,
        response_tokens: int,
        model_path: str,
        response_option: str = "sampling.max_tokens",
    ) -> VLLMServerSpec:
        """Launched servers: ``max_model_len`` fitted as the in-process engine's does it."""
        if self.launch is None:
            return self
        given = VLLMEngineSpec(max_model_len=self.launch.get("max_model_len"))
        fitted = given.sized(prompt_tokens, response_tokens, model_path, response_option)
        return dataclasses.replace(self, launch={**self.launch, "max_model_len": fitted.max_model_len})

    def build(self, context: EngineContext) -> VLLMServerEngine:
        """The engine, serving the actor's weights. Under several trainer ranks: rank 0 starts (or
        waits for) the servers and hands their URLs to the others; the others wait for its first push."""
        servers = self._started(context) if context.rank == 0 else []
        urls = from_rank_zero([server.url for server in servers])
        if context.rank != 0:
            servers = [Server(ServerClient(url, self.request_timeout_s)) for url in urls]
        heals = self.max_restarts if context.rank == 0 else 0  # the other ranks follow rank 0's news
        pool = ServerPool(servers, context.rank == 0, heals, self.startup_timeout_s)
        host = self.transfer_host or _transfer_host(self.urls)

        def connect(joined: list[Server]) -> None:
            others = [server for server in pool.alive if server not in joined]
            connect_senders(joined, self.transfer, host, self.request_timeout_s, others)

        try:
            lengths = {server.url: _max_model_len(server.client) for server in servers}
            if context.rank == 0:
                connect(servers)
            engine = VLLMServerEngine(
                pool, min(lengths.values()), context.bucket_bytes, context.world_size, context.rank, connect
            )
            engine.load_weights(context.weights(), context.policy_version)
            barrier()  # no rank generates before rank 0's push is done
        except BaseException:
            pool.close()
            raise
        return engine

    def _started(self, context: EngineContext) -> list[Server]:
        """The servers, each answering ``/health``: launched, or given by ``urls``."""
        servers = list(self._start(context))
        try:
            for server in servers:
                if server.launched is None:  # one that runs already, or still starts (a SLURM job's)
                    wait_healthy(server.client, self.startup_timeout_s)
        except BaseException:
            ServerPool(servers).close()
            raise
        return servers

    def _start(self, context: EngineContext) -> Iterator[Server]:
        if self.urls:
            yield from (Server(ServerClient(url, self.request_timeout_s)) for url in self.urls)
            return
        options = {"dtype": context.dtype, "enforce_eager": True, "seed": 0, **self.launch}
        count = options.pop("servers", 1)
        logs = (
            Path(context.log_file).parent
            if context.log_file
            else Path(tempfile.mkdtemp(prefix="vllm-servers-"))
        )
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        launched = [
            LaunchedServer(
                context.model_path,
                options,
                logs / f"vllm_server{i}.log",
                {**env, **cpu_binding(i, count)},
                host="127.0.0.1",
            )
            for i in range(count)
        ]
        servers = [Server(ServerClient(server.url, self.request_timeout_s), server) for server in launched]
        try:
            for server in servers:
                server.launched.wait_healthy(server.client, self.startup_timeout_s)
        except BaseException:
            ServerPool(servers).close()
            raise
        yield from servers


def cpu_binding(index: int, count: int) -> dict[str, str]:
    """On CPU, server ``index`` of ``count`` gets its own share of this process's cores (vLLM binds
    every CPU server to the first core otherwise); nothing where the user set VLLM_CPU_OMP_THREADS_BIND."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):  # more servers than cores: one core each, in turn
        share = [cores[index % len(cores)]]
    else:
        share = cores[index * len(cores) // count : (index + 1) * len(cores) // count]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))}


def wait_healthy(client: ServerClient, timeout_s: float) -> None:
    """Return once ``client``'s server answers ``/health``; a one-line ServerError naming it if it
    does not within ``timeout_s``."""
    if not client.wait_healthy(timeout_s):
        raise ServerError(
            f"rollout server {client.url} does not answer /health (waited {timeout_s:.0f} s, "
            "startup_timeout_s): is it started, and reachable from the trainer?"
        )


def _max_model_len(client: ServerClient) -> int:
    models = client.get("/v1/models")["data"]
    return int(models[0]["max_model_len"])


def _transfer_host(urls: list[str]) -> str:
    if all(urlparse(url).hostname in _LOOPBACK for url in urls):
        return "127.0.0.1"
    return socket.gethostname()


__all__ = ["ServersLostError", "VLLMServerEngine", "VLLMServerSpec", "token_versions"]
