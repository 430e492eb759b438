"""Built-in rewards: math-verify, GSM8K, format regex and a reward model, on hand-checked cases."""

import pickle
import threading

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification

from lit_offpolicy.core.registry import component_config
from lit_offpolicy.models import build_tokenizer, tiny_llama_config
from lit_offpolicy.rewards import (
    REWARDS,
    FormatReward,
    GSM8KAnswer,
    MathVerify,
    ModelReward,
    RewardConfig,
    RewardInputs,
    RewardOutput,
)

# ----------------------------------------------------------------------------- math_verify


def test_math_verify_hand_checked_equivalences():
    completions = [
        "so \\boxed{\\frac{1}{2}}",  # 1/2 = 0.5
        "\\boxed{2x+2}",  # = 2(x+1)
        "\\boxed{3}",  # != 4
        "\\boxed{[1, 3)}",  # the same interval
        "\\boxed{(1,3]}",  # open at the other end
        "\\boxed{\\{1,2\\}}",  # sets compare without order
        "The final answer is $\\frac{1}{2}$.",  # no box: the anchored expression
        "\\boxed{3} then \\boxed{7}",  # two boxes read as the set {3, 7}
    ]
    answers = ["0.5", "2(x+1)", "4", "[1,3)", "[1,3)", "\\{2,1\\}", "1/2", "7"]
    out = MathVerify()(completions=completions, answer=answers)
    assert out == RewardOutput([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], num_malformed=0)


def test_math_verify_garbage_is_malformed_and_never_raises():
    completions = [
        "garbage text !!",
        "",
        None,
        "\\boxed{",
        "}}}{{{\\boxed",
        "\\boxed{\\frac{1}{0}}",
        "\\boxed{4}",
    ]
    out = MathVerify()(completions=completions, answer=["4"] * len(completions))
    assert out.scores == [0.0] * 6 + [1.0]
    assert out.num_malformed == 5  # \frac{1}{0} parses (to complex infinity) and is wrong, not malformed


def test_math_verify_reads_chat_completions_and_full_solution_answers():
    chat = [
        [{"role": "assistant", "content": "it is \\boxed{\\sqrt{2}/2}"}],
        [{"role": "assistant", "content": "\\boxed{6}"}],
        [{"role": "assistant", "content": "x"}],  # no anchor, no box, no number: nothing to extract
    ]
    answers = ["The answer is $\\frac{1}{\\sqrt{2}}$", "so \\boxed{5}", "x"]
    assert MathVerify()(completions=chat, answer=answers) == RewardOutput([1.0, 0.0, 0.0], num_malformed=1)


def test_math_verify_unreadable_reference_does_not_apply():
    out = MathVerify()(completions=["\\boxed{1}", "garbage !!"], answer=["", "1"])
    assert out == RewardOutput([None, 0.0], num_malformed=1)


def test_math_verify_in_a_thread_runs_without_the_signal_timeout():
    """math-verify's alarm only works in the main thread (it raises ValueError elsewhere)."""
    results = []
    thread = threading.Thread(
        target=lambda: results.append(
            MathVerify()(completions=["\\boxed{0.5}", "\\boxed{2}"], answer=["1/2"] * 2)
        )
    )
    thread.start()
    thread.join()
    assert results == [RewardOutput([1.0, 0.0], num_malformed=0)]


def test_math_verify_timeout_is_whole_seconds():
    with pytest.raises(ValueError, match="timeout=1.5 must be a whole number"):
        MathVerify(timeout=1.5)
    with pytest.raises(ValueError, match="timeout=0 is out of range"):
        MathVerify(timeout=0)


def test_math_verify_in_an_isolated_worker():
    reward = RewardConfig(fn="math_verify", timeout=30.0).build()
    try:
        out = reward(
            RewardInputs.of([{"prompt": "?", "answer": "0.5"}], ["\\boxed{\\frac12}", "no"], [[1], [2]], 2)
        )
    finally:
        reward.close()
    assert (out.scores, out.num_malformed, out.num_errors) == ([1.0, 0.0], 1, 0)


# ----------------------------------------------------------------------------- gsm8k

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_gsm8k_strict_reads_the_number_after_the_last_hashes():
    completions = [
        "48+24 = 72\n#### 72",
        "####72",  # no space
        "#### 1,000",  # commas dropped
        "#### $1,000.00",  # dollar sign, decimals
        "#### 72.",  # trailing full stop
        "#### 71 no wait\n#### 72",  # the last answer line counts
        "#### -3",
        "#### 73",
        "72",  # no answer line: malformed
        "#### seventy-two",  # no number after it: malformed
        [{"role": "assistant", "content": "#### 72"}],
    ]
    answers = [SOLUTION, "72", "1000", "1000", "72", "72", "-3", "72", "72", "72", SOLUTION]
    out = GSM8KAnswer()(completions=completions, answer=answers)
    assert out == RewardOutput([1.0] * 7 + [0.0, 0.0, 0.0, 1.0], num_malformed=2)


def test_gsm8k_flexible_reads_the_last_number():
    completions = ["so she sold 72 clips.", "24 then 72, done", "3 and 1,000", "seventy-two", "#### 72 or 71"]
    out = GSM8KAnswer(method="flexible")(completions=completions, answer=[SOLUTION, "72", "1000", "72", "72"])
    assert out == RewardOutput([1.0, 1.0, 1.0, 0.0, 0.0], num_malformed=1)


def test_gsm8k_unreadable_reference_does_not_apply_and_bad_method_is_named():
    assert GSM8KAnswer()(completions=["#### 1", "#### 1"], answer=["one", "#### ?"]).scores == [None, None]
    with pytest.raises(
        ValueError, match="method='loose' is not supported; allowed values: 'strict', 'flexible'"
    ):
        GSM8KAnswer(method="loose")


# ----------------------------------------------------------------------------- format


def test_format_reward_default_think_answer_layout():
    completions = [
        "<think>a\nb</think>\n<answer>42</answer>",
        "<think></think><answer></answer>\n",  # $ allows one final newline
        "<think>x</think><answer>1</answer> trailing",
        "preamble <think>x</think><answer>1</answer>",
        "<answer>1</answer>",
        "<think>x</think>",
        [{"role": "assistant", "content": "<think>x</think> <answer>1</answer>"}],
        None,
    ]
    assert FormatReward()(completions=completions) == RewardOutput(
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0], 0
    )


def test_format_reward_custom_pattern_searches_anywhere_unless_anchored():
    assert FormatReward(r"\\boxed\{.+\}")(completions=["so \\boxed{4}.", "4"]).scores == [1.0, 0.0]
    assert FormatReward(r"^\d+$")(completions=["12", "12 apples"]).scores == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"pattern='\(' is not a regular expression"):
        FormatReward("(")


def test_weighted_built_ins_from_a_config():
    """The documented YAML: math_verify plus a tenth of a custom format reward."""
    config = RewardConfig(
        fn=[
            "math_verify",
            {
                "class_path": "lit_offpolicy.rewards.FormatReward",
                "init_args": {"pattern": r"^<answer>.*</answer>$"},
            },
        ],
        weights=[1.0, 0.1],
        timeout=None,
    )
    rewards = config.build()
    texts = ["<answer>\\boxed{4}</answer>", "\\boxed{4}", "<answer>5</answer>"]
    out = rewards(RewardInputs.of([{"prompt": "2+2=", "answer": "4"}], texts, [[1]] * 3, n=3))
    assert out.scores == pytest.approx([1.1, 1.0, 0.1])  # python floats 1·s + 0.1·f: one rounding ≪ 1e-6
    assert out.by_function == {"math_verify": [1.0, 1.0, 0.0], "FormatReward": [1.0, 0.0, 1.0]}


# ----------------------------------------------------------------------------- ModelReward

CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"


def save_reward_model(path, num_labels=1, chat_template=None, padding_side="right", pad_in_config=True):
    """A tiny Llama classifier (hidden 32, 1 layer, random weights) and the character tokenizer."""
    tokenizer = build_tokenizer()
    tokenizer.padding_side = padding_side
    if chat_template:
        tokenizer.chat_template = chat_template
    config = tiny_llama_config(
        len(tokenizer),
        hidden_size=32,
        num_layers=1,
        heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    config.num_labels = num_labels
    config.pad_token_id = tokenizer.pad_token_id if pad_in_config else None
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def direct_logits(path, text, add_special_tokens=True):
    """The saved model's logits for one text alone: no batch, no padding."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(
        text, add_special_tokens=add_special_tokens, return_tensors="pt"
    )
    with torch.no_grad():
        return model(input_ids=ids["input_ids"]).logits[0]


# A score is the 32-term dot product of the final hidden state (RMS-normalised, entries ~1) with a head
# of std 0.02, whose terms total ≲ 0.02 × 32 = 0.64. Batched and padded, the block's sums (≤ 64 terms)
# and this one are grouped otherwise than for a text alone: 2 × eps32 (1.19e-7) × √64 × 0.64 ≈ 1.2e-6,
# hence SCORE_TOL = 2e-6 (measured: 1.5e-8).
SCORE_TOL = 2e-6
PROMPTS = ["2+2=", "What is 7*6? ", "", "Name a prime: ", "1+1="]
COMPLETIONS = ["4", "It is 42, because 7*6=42.", "hello", [{"role": "assistant", "content": "13"}], "2" * 40]


@pytest.mark.parametrize(
    "options",
    [{}, {"padding_side": "left"}, {"pad_in_config": False}],
    ids=["right", "left", "no-pad-in-config"],
)
def test_model_reward_equals_a_direct_forward_in_any_batch_size(tmp_path, options):
    path = save_reward_model(tmp_path, **options)
    texts = [
        p + (c if isinstance(c, str) else c[0]["content"]) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
    ]
    expected = [direct_logits(path, text)[0].item() for text in texts]
    for batch_size in (1, 3, 8):
        scores = ModelReward(path, batch_size=batch_size, device="cpu")(
            prompts=PROMPTS, completions=COMPLETIONS
        )
        assert scores == pytest.approx(expected, abs=SCORE_TOL)
    assert len(set(expected)) == len(expected)  # the texts do get different scores


def test_model_reward_renders_messages_with_the_chat_template(tmp_path):
    path = save_reward_model(tmp_path, chat_template=CHAT_TEMPLATE)
    reward = ModelReward(path, batch_size=2, device="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    assert reward.render(messages, [{"role": "assistant", "content": "4"}]) == (
        "<bos>[system]Be brief.\n[user]2+2=\n[assistant]4\n"
    )
    assert reward.render("2+2=", "4") == "<bos>[user]2+2=\n[assistant]4\n"  # a string prompt: one user turn
    scores = reward(
        prompts=[messages, "2+2=", "3+3="], completions=[[{"role": "assistant", "content": "4"}], "4", "6"]
    )
    texts = ["<bos>[system]Be brief.\n[user]2+2=\n[assistant]4\n", "<bos>[user]2+2=\n[assistant]4\n"]
    texts.append("<bos>[user]3+3=\n[assistant]6\n")
    expected = [direct_logits(path, text, add_special_tokens=False)[0].item() for text in texts]
    assert scores == pytest.approx(expected, abs=SCORE_TOL)


def test_model_reward_without_a_template_joins_message_contents(tmp_path):
    reward = ModelReward(save_reward_model(tmp_path), device="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    assert reward.render(messages, [{"role": "assistant", "content": "4"}]) == "Be brief.\n2+2=4"


def test_model_reward_two_labels_give_the_log_odds_of_label_one(tmp_path):
    path = save_reward_model(tmp_path, num_labels=2)
    logits = direct_logits(path, "2+2=4")
    assert ModelReward(path, device="cpu")(prompts=["2+2="], completions=["4"]) == pytest.approx(
        [(logits[1] - logits[0]).item()],
        abs=2 * SCORE_TOL,  # a difference of two scores
    )


def test_model_reward_keeps_the_end_of_long_texts(tmp_path):
    path = save_reward_model(tmp_path)
    reward = ModelReward(path, device="cpu", max_length=10)
    assert (
        reward.encode("x" * 50, "0123456789")
        == AutoTokenizer.from_pretrained(path)("0123456789")["input_ids"][1:]
    )
    expected = direct_logits(path, "0123456789", add_special_tokens=False)[0].item()
    assert reward(prompts=["x" * 50], completions=["0123456789"]) == pytest.approx([expected], abs=SCORE_TOL)


def test_model_reward_bad_directories_name_model_path(tmp_path):
    with pytest.raises(ValueError, match="model_path='my-reward-model' is not a directory"):
        ModelReward("my-reward-model")  # not looked up on the Hub
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model_path=.*empty.* is not a Hugging Face model directory"):
        ModelReward(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="has 3 labels; ModelReward reads a model with 1"):
        ModelReward(save_reward_model(tmp_path / "three", num_labels=3))
    with pytest.raises(ValueError, match="batch_size=0 is out of range"):
        ModelReward(save_reward_model(tmp_path / "one"), batch_size=0)


@pytest.mark.slow  # a spawned process: test-numerics leaves it out
def test_model_reward_pickles_without_its_model_and_scores_in_a_spawned_worker(tmp_path):
    path = save_reward_model(tmp_path)
    reward = ModelReward(path, device="cpu")
    expected = reward(prompts=["2+2="], completions=["4"])
    assert pickle.loads(pickle.dumps(reward))._loaded is None
    fn = {"class_path": "lit_offpolicy.rewards.ModelReward", "init_args": {"model_path": path}}
    with pytest.raises(
        ValueError, match="reward.fn 'ModelReward' runs a torch model, which hangs or fails in"
    ):
        RewardConfig(fn=fn).build()  # fork, the default: its forward hangs after vLLM ran in the trainer
    # the deadline covers the fresh interpreter's imports too: over a minute on a loaded 2-core machine
    isolated = RewardConfig(fn=fn, start_method="spawn", timeout=600.0).build()
    try:
        out = isolated(RewardInputs.of([{"prompt": "2+2=", "answer": ""}], ["4"], [[1]]))
    finally:
        isolated.close()
    # the same batch of one in another process: SCORE_TOL covers another grouping of its sums
    assert (out.num_timeouts, out.num_errors) == (0, 0)
    assert out.scores == pytest.approx(expected, abs=SCORE_TOL)


def test_built_ins_keep_their_options_for_the_saved_config(tmp_path):
    path = save_reward_model(tmp_path)
    for reward in (MathVerify(timeout=2), GSM8KAnswer("flexible"), FormatReward("^a$"), ModelReward(path, 4)):
        rebuilt = REWARDS.resolve(component_config(reward))
        assert type(rebuilt) is type(reward) and component_config(rebuilt) == component_config(reward)
    assert component_config(ModelReward(path, 4))["init_args"] == {
        "model_path": path,
        "batch_size": 4,
        "device": None,
        "max_length": 1024,
    }
