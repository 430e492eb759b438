"""``JudgeReward`` with a judge whose answers we control: a one-layer Llama whose attention and MLP add
nothing (``o_proj`` and ``down_proj`` zero), with one-hot embeddings and a head that maps each
character to the next it writes. Greedy, it continues a digit with that digit forever and anything
else with ``?``: so the judge's rating of a completion is the completion's last character, when that
is a digit, and unparseable otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_offpolicy.models import load_tokenizer
from lit_offpolicy.rewards import (
    IsolatedReward,
    JudgeReward,
    RewardConfig,
    RewardContractError,
    RewardInputs,
    RewardOutput,
    WeightedRewards,
    count_metrics,
)

DIGIT = r"(\d)"


def write_controlled_judge(directory: Path, tokenizer_dir: str) -> Path:
    """The judge described in the module's docstring, with the built-in character tokenizer."""
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,  # at least the vocabulary: one-hot embeddings
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    question = tokenizer.convert_tokens_to_ids("?")
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for token in range(vocab):
            model.model.embed_tokens.weight[token, token] = 1.0
            text = tokenizer.convert_ids_to_tokens(token)
            model.lm_head.weight[token if text.isdigit() else question, token] = 10.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, tiny_model_dir) -> str:
    return str(write_controlled_judge(tmp_path_factory.mktemp("judge") / "judge", tiny_model_dir))


def test_the_judge_s_rating_is_parsed_and_scaled(judge_dir):
    judge = JudgeReward(model_path=judge_dir, template="{completion}", parser=DIGIT, scale=0.1, batch_size=2)
    out = judge(prompts=["p"] * 4, completions=["a 7", "b 3", "no rating", "0"])
    assert out.scores == [7 * 0.1, 3 * 0.1, None, 0.0]  # the parsed digit times scale, exactly
    assert out.counts == {"judge_unparsed": 1}
    assert judge._generate(["x 4"]) == ["4" * judge.max_new_tokens]


def test_the_template_reads_the_prompt_and_the_row_s_columns(judge_dir):
    """Chat prompts become their messages' contents; ``{answer}`` is the row's column. The judge here
    rates by the template's last character: the answer's."""
    judge = JudgeReward(
        model_path=judge_dir, template="Q: {prompt} A: {completion} Ref: {answer}", parser=DIGIT
    )
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}]
    assert judge.render([chat], ["5"], {"answer": ["5"]}, 0) == "Q: be brief\n2+3= A: 5 Ref: 5"
    assert judge(prompts=[chat, "1+1="], completions=["x", "y"], answer=["5", "2"]).scores == [5.0, 2.0]
    with pytest.raises(
        RewardContractError, match=r"JudgeReward.template names \{solution\}, which the data row"
    ):
        JudgeReward(model_path=judge_dir, template="{solution}")(
            prompts=["p"], completions=["c"], answer=["1"]
        )


def parse_rating(text: str) -> float | None:
    """A parser by import path: "7777" -> 7."""
    return float(text[0]) if text[:1].isdigit() else None


def test_options_are_checked_and_a_parser_may_be_a_function(judge_dir):
    with pytest.raises(ValueError, match="needs one judge: model_path"):
        JudgeReward()
    with pytest.raises(ValueError, match="needs one judge"):
        JudgeReward(model_path=judge_dir, url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"parser='\(' is neither a regular expression"):
        JudgeReward(model_path=judge_dir, parser="(")
    with pytest.raises(ValueError, match="parser='no_such_module:f' does not import"):
        JudgeReward(model_path=judge_dir, parser="no_such_module:f")
    judge = JudgeReward(model_path=judge_dir, template="{completion}", parser=f"{__name__}:parse_rating")
    assert judge(prompts=["p", "p"], completions=["9", "?"]).scores == [9.0, None]


def test_a_missing_judge_directory_is_refused_when_the_judge_is_built(tmp_path):
    """At start-up, naming the option; it was read at the first batch, and looked up on the Hub."""
    with pytest.raises(
        FileNotFoundError, match=r"^JudgeReward.model_path: model directory .*nowhere does not"
    ):
        JudgeReward(model_path=str(tmp_path / "nowhere"))


def test_a_local_judge_is_refused_in_forked_workers_and_runs_in_process(judge_dir):
    spec = {"class_path": "lit_offpolicy.rewards.JudgeReward", "init_args": {"model_path": judge_dir}}
    with pytest.raises(ValueError, match="runs a torch model, which hangs or fails in a worker forked"):
        RewardConfig(fn=spec).build()
    rewards = RewardConfig(fn=[spec, "exact"], timeout=None).build()
    problems = [{"prompt": "1+1=", "answer": "2"}]
    out = rewards(RewardInputs.of(problems, ["2"], [[0]]))
    assert out.counts == {"judge_unparsed": 1}  # the default template ends in "Rating:", which is no digit
    assert count_metrics([out]) == {"reward/judge_unparsed_fraction": 1.0}


def counted(completions, **kwargs) -> RewardOutput:
    return RewardOutput(
        [1.0] * len(completions), 0, counts={"judge_unparsed": sum(c == "?" for c in completions)}
    )


def test_named_counts_cross_the_worker_processes():
    reward = IsolatedReward(WeightedRewards({"counted": counted}), timeout=30.0, num_workers=2)
    try:
        problems = [{"prompt": "p", "answer": "a"}] * 4
        out = reward(RewardInputs.of(problems, ["?", "x", "?", "?"], [[0]] * 4))
    finally:
        reward.close()
    assert out.counts == {"judge_unparsed": 3}
    assert count_metrics([out, RewardOutput([0.0] * 4, 0)]) == {"reward/judge_unparsed_fraction": 3 / 8}
