"""The benchmark code itself: the ratio convention, the bare-loop baseline's math, the results table and plot.

No timing is asserted here: benchmarks report figures and never fail on a slow machine.
"""

import copy
import json

import pytest
import torch

from benchmarks import common, plot, results_table
from benchmarks.common import entry, fit_on_fixed_experience, fixed_experience
from benchmarks.pytorch import bare_loop
from benchmarks.pytorch.train_step import bare_optimizer, build_module
from lit_offpolicy.models import load_tokenizer


def test_entry_ratio_is_higher_is_better_for_us():
    seconds = entry("step", "s", ours=2.0, baseline=3.0, repeats=5, workload="w")
    assert seconds["ratio"] == 1.5  # costs: baseline / ours
    assert seconds["workload"] == "w" and seconds["repeats"] == 5 and "torch" in seconds["machine"]
    assert entry("mem", "MiB", ours=400.0, baseline=200.0, repeats=5)["ratio"] == 0.5
    assert entry("rate", "tokens/s", ours=3.0, baseline=4.0, repeats=5)["ratio"] == 0.75  # ours / baseline
    assert entry("acc", "accuracy", ours=0.5, baseline=0.0, repeats=1)["ratio"] is None


def test_alternate_takes_turns_and_drops_the_warm_up_round():
    calls = []

    def side(name):
        def measure():
            calls.append(name)
            return len(calls)

        return measure

    assert common.alternate({"a": side("a"), "b": side("b")}, repeats=2) == {"a": [3, 5], "b": [4, 6]}
    assert calls == ["a", "b"] * 3


def test_timed_syncs_before_the_clock_starts_and_before_it_stops(monkeypatch):
    events, ticks = [], iter([1.0, 3.5])
    monkeypatch.setattr(common.time, "perf_counter", lambda: events.append("clock") or next(ticks))
    seconds, result = common.timed(lambda: events.append("call") or 7, sync=lambda: events.append("sync"))
    assert (seconds, result) == (2.5, 7)
    assert events == ["sync", "clock", "call", "sync", "clock"]


def test_step_clock_leaves_after_step_out_of_the_next_step(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    clock = common.StepClock(after_step=lambda: now.__setitem__(0, now[0] + 10.0))
    clock.start()
    now[0] = 2.0
    clock.step_end()
    now[0] += 3.0
    clock.step_end()
    assert clock.seconds == [2.0, 3.0]
    assert common.medians([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 1.0}, {"x": 2.0, "y": 2.0}]) == {
        "x": 2.0,
        "y": 2.0,
    }


def test_accuracy_standard_error_is_the_larger_binomial_one():
    from benchmarks.peers.end_to_end_trl import binomial_standard_error

    # 256 held-out problems; python floats, a product and a square root: a few eps64 ≪ approx's rel 1e-6
    assert binomial_standard_error(0.5, 0.9) == pytest.approx((0.25 / 256) ** 0.5)
    assert binomial_standard_error(1.0) == 0.0


def test_fixed_experience_has_the_demo_shapes(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    exp = fixed_experience(tokenizer, num_prompts=6, group_size=4, response_length=16)
    assert exp.response_ids.shape == (24, 16) and exp.group_ids.tolist() == [i // 4 for i in range(24)]
    lengths = exp.response_mask.sum(-1)
    assert lengths.min() >= 4 and lengths.max() <= 16
    last = exp.response_ids[torch.arange(24), lengths - 1]
    assert (last == tokenizer.eos_token_id).all()  # each response ends in eos, then padding
    assert (exp.prompt_mask[:, -1] == 1).all()  # prompts are left-padded


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_bare_loop_makes_the_same_update_as_the_module(tiny_model_dir, tmp_path, algorithm):
    """The baseline is only fair if it does the same math: one step of each from the same weights
    must move the actor (and critic) the same way."""
    exp = fixed_experience(load_tokenizer(tiny_model_dir), num_prompts=8, seed=1)
    module = build_module(tiny_model_dir, algorithm)
    models = [module.actor] + ([module.critic] if module.critic is not None else [])
    initial = [copy.deepcopy(m) for m in models]
    bare = [copy.deepcopy(m) for m in models]
    actor, critic = bare[0], (bare[1] if len(bare) > 1 else None)
    bare_loop.step(actor, bare_optimizer(actor, critic), exp, critic)
    fit_on_fixed_experience(module, exp, 1, [], str(tmp_path))
    for start, ours, theirs in zip(initial, models, bare, strict=True):
        ours_update, bare_update = update(start, ours), update(start, theirs)
        assert ours_update.norm() > 1e-3  # the step did move the weights
        # One AdamW step from the same weights moves each entry by lr·g/(|g| + ε): ±lr wherever |g| ≫
        # ε = 1e-8, whatever the float32 rounding of g, so the two loops' differently grouped sums
        # (≲ 2.2e-5 relative, helpers.tolerances) reach the update only through entries with |g| ≲
        # 100 ε, whose sums are as small (measured: ≤ 2e-5 of the norm; halving the clip norm, a real
        # difference, gives 5e-3); an entry whose g is within rounding of 0 could flip its sign and
        # cost 2/√N ≈ 2e-3 of the norm (N ≈ 1M weights), which none does for this batch
        assert (ours_update - bare_update).norm() / ours_update.norm() < 1e-4


def update(start: torch.nn.Module, end: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p - q).flatten() for p, q in zip(end.parameters(), start.parameters(), strict=True)])


RESULTS = [
    {"name": "train_step_vs_torch_grpo", "unit": "tokens/s", "ours": 2500.0, "baseline": 2400.0,
     "ratio": 1.042, "repeats": 5, "machine": "m", "target": 0.9},
    {"name": "vllm_weight_sync", "unit": "s", "ours": 0.03, "baseline": 1.5, "ratio": 50.0,
     "repeats": 5, "machine": "m", "fraction": 0.02},
    {"name": "end_to_end_vs_trl", "unit": "s", "ours": 1.0, "baseline": 1.5, "ratio": 1.5,
     "repeats": 29, "machine": "x86_64 2 CPUs, torch 2.13.0+cpu (2 threads)", "target": 2.0},
    {"name": "memory_vs_trl_cuda", "unit": "MiB", "ours": 1.0, "baseline": 0.5, "ratio": 0.5, "repeats": 1,
     "machine": "x86_64 16 CPUs, NVIDIA H100 80GB HBM3, torch 2.11.0+cu130 (16 threads)"},
]  # fmt: skip


def test_results_table_fills_only_the_marked_block(tmp_path, monkeypatch):
    results, page = tmp_path / "results.json", tmp_path / "benchmarks.md"
    results.write_text(json.dumps(RESULTS))
    page.write_text(f"# title\n\n{results_table.START}\nold table\n{results_table.END}\n\n## Next\n")
    monkeypatch.setattr(results_table, "RESULTS", results)
    monkeypatch.setattr(results_table, "PAGE", page)
    results_table.main()
    first = page.read_text()
    results_table.main()
    assert page.read_text() == first  # regenerating is idempotent
    assert first.startswith("# title\n") and first.endswith("\n\n## Next\n") and "old table" not in first
    rows = [line for line in first.splitlines() if line.startswith("| `")]
    assert rows[0] == (
        "| `train_step_vs_torch_grpo` | m | tokens/s | 2,500 | 2,400 | 1.04 | 5 | target ≥ 0.9 (met) |"
    )
    assert rows[1] == "| `vllm_weight_sync` | m | s | 0.03 | 1.5 | 50 | 5 | 2% of a step |"
    assert rows[2].startswith("| `end_to_end_vs_trl` | CPU, 2 cores | s |")
    assert rows[2].endswith("| target ≥ 2 (not met) |")
    assert rows[3].startswith("| `memory_vs_trl_cuda` | NVIDIA H100 80GB HBM3 | MiB |")


def test_results_table_needs_the_markers(tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    (tmp_path / "benchmarks.md").write_text("# no markers\n")
    monkeypatch.setattr(results_table, "RESULTS", tmp_path / "results.json")
    monkeypatch.setattr(results_table, "PAGE", tmp_path / "benchmarks.md")
    with pytest.raises(ValueError, match="benchmarks:start"):
        results_table.main()


def test_the_benchmarks_page_holds_the_table_block():
    """make bench fills docs/benchmarks.md's table (the README links to it), once."""
    text = results_table.PAGE.read_text()
    assert text.count(results_table.START) == 1 and text.count(results_table.END) == 1


def test_plot_draws_the_results(tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    monkeypatch.setattr(plot, "RESULTS", tmp_path / "results.json")
    plot.main(tmp_path / "benchmarks.png")
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_vs_trl_batch_is_fixed_left_padded_with_group_advantages():
    from benchmarks.peers.memory_vs_trl import GROUP, fixed_batch

    batch = fixed_batch(8, prompt_length=16, response_length=40, vocab=1000)
    assert batch["prompt_ids"].shape == (8, 16) and batch["response_ids"].shape == (8, 40)
    assert (batch["prompt_mask"][:, -1] == 1).all() and batch["prompt_mask"][0].all()  # left-padded
    lengths = batch["response_mask"].sum(-1)
    assert lengths[0] == 40 and lengths.min() >= 30  # right-padded, 3/4 .. 1 of the width
    assert (batch["response_ids"][batch["response_mask"] == 0] == 0).all()
    assert batch["group_ids"].tolist() == [i // GROUP for i in range(8)]
    advantages = batch["advantages"].view(-1, GROUP)
    # float32 pairs ±a (|a| < 1/√2 after the std division): a 2-term mean, ≤ 2 roundings of 0.7, 1.7e-7
    torch.testing.assert_close(advantages.mean(1), torch.zeros(8 // GROUP), rtol=0, atol=1e-6)
    again = fixed_batch(8, prompt_length=16, response_length=40, vocab=1000)
    assert all(torch.equal(batch[key], again[key]) for key in batch)  # both sides get the same batch


@pytest.mark.parametrize(
    ("start", "resolution", "limit", "expected"),
    [
        (256, 256, 3000, (2816, 3072)),  # doubles, then bisects
        (256, 256, 512, (512, 768)),
        (256, 256, 256, (256, 512)),
        (256, 256, 100, (0, 256)),  # not even the resolution fits
        (1024, 128, 700, (640, 768)),  # the start does not fit: halves, then bisects
        (1024, 128, 300, (256, 384)),
        (1024, 128, 150, (128, 256)),
    ],
)
def test_search_largest_brackets_the_limit_then_bisects(start, resolution, limit, expected):
    from benchmarks.peers.memory_vs_trl import search_largest

    tried = []

    def fits(length: int) -> bool:
        tried.append(length)
        return length <= limit

    assert search_largest(fits, start, 65536, resolution) == expected
    assert all(length % resolution == 0 for length in tried) and len(tried) == len(set(tried))


def test_search_largest_stops_at_the_maximum():
    from benchmarks.peers.memory_vs_trl import search_largest

    assert search_largest(lambda length: True, 512, 4096, 256) == (4096, None)


def test_update_throughput_batch_shares_prompts_per_group_and_spreads_lengths():
    from benchmarks.peers.update_throughput_vs_trl import GROUP, fixed_batch, parse

    args = parse(["--prompts", "3", "--prompt-length", "10", "--min-response", "16", "--max-response", "64"])
    batch = fixed_batch(args, vocab=1000)
    assert batch["prompt_ids"].shape == (3 * GROUP, 10) and batch["response_ids"].shape == (3 * GROUP, 64)
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][GROUP - 1])  # a group shares its prompt
    assert not torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][GROUP])
    assert (batch["prompt_mask"][:, -1] == 1).all() and batch["prompt_mask"].sum(-1).min() >= 5  # left-padded
    lengths = batch["response_mask"].sum(-1)
    assert lengths.min() >= 16 and lengths.max() <= 64 and len(set(lengths.tolist())) > GROUP  # spread
    assert (batch["response_ids"][batch["response_mask"] == 0] == 0).all()
    again = fixed_batch(args, vocab=1000)
    assert all(torch.equal(batch[key], again[key]) for key in batch)  # every side gets the same batch


def test_regions_split_a_step_into_exclusive_seconds(monkeypatch):
    """A region's seconds exclude the wrapped calls it makes; ``other`` is what no region covered
    (a clock advanced by hand stands in for time)."""
    from benchmarks import step_profile

    now = [0.0]
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: now[0])

    class Work:
        def inner(self):
            now[0] += 2.0

        def outer(self):
            now[0] += 1.0
            self.inner()
            now[0] += 0.5

    regions = step_profile.Regions()
    regions.wrap(Work, "outer", "outer")
    regions.wrap(Work, "inner", "inner")
    Work().outer()
    regions.end_step(4.0)
    Work().inner()
    regions.end_step(3.0)
    assert regions.steps == [{"outer": 1.5, "inner": 2.0, "other": 0.5}, {"inner": 2.0, "other": 1.0}]
    assert regions.medians(skip_first=1) == {"inner": 2.0, "other": 1.0}


def test_end_to_end_validation_accuracy_scores_the_held_out_problems(tiny_model_dir):
    from benchmarks.peers.end_to_end_trl import validation_accuracy
    from lit_offpolicy.models import load_actor

    accuracy = validation_accuracy(load_actor(tiny_model_dir), load_tokenizer(tiny_model_dir))
    assert accuracy == 0.0  # random weights: no exact answer among the 256 problems


def test_packed_attention_micro_batch_fits_the_budget_and_the_masked_side_restores():
    import lit_offpolicy.training.packed_attention as packed_attention
    from benchmarks.pytorch.packed_attention import masked_row, micro_batch
    from lit_offpolicy.training.packing import sample_lengths

    exp = micro_batch(1500)
    lengths = sample_lengths(exp)
    assert lengths.sum() <= 1500 and len(exp) >= 3 and lengths.min() < lengths.max()
    kept = packed_attention.PER_SAMPLE_MODEL_TYPES
    with masked_row():
        assert not packed_attention.PER_SAMPLE_MODEL_TYPES
    assert packed_attention.PER_SAMPLE_MODEL_TYPES is kept


def test_the_code_benchmark_scores_each_layout_s_canonical_solutions_in_its_own_columns():
    from benchmarks.engines.code_harness import FIXTURES, batch

    for layout, columns in {
        "mbpp": {"test_list", "test_setup_code"},
        "humaneval": {"test", "entry_point"},
    }.items():
        rows = (FIXTURES / "code_benchmarks" / f"{layout}.jsonl").read_text().splitlines()
        inputs = batch([json.loads(row) for row in rows])
        assert len(inputs) == 100 and columns <= set(inputs.columns)
        assert all(text.startswith("```python\n") and text.endswith("\n```") for text in inputs.completions)


def test_shared_prefix_batch_shares_each_prompt_and_every_layout_gives_the_same_log_probs(tiny_model_dir):
    from benchmarks.pytorch.shared_prefix import GROUP, SIDES, batch, run_case, token_ratio
    from lit_offpolicy.models import load_actor

    exp = batch(2, prompt=12, response=5, vocab=100)
    assert exp.prompt_ids.shape == (2 * GROUP, 12) and exp.response_mask.sum().item() == 2 * GROUP * 5
    assert torch.equal(exp.prompt_ids[0], exp.prompt_ids[GROUP - 1])  # a group shares its prompt
    assert not torch.equal(exp.prompt_ids[0], exp.prompt_ids[GROUP])
    assert token_ratio(1024, 128) == 4.5  # the figure: 8 · 1,152 / (1,024 + 8 · 128)
    model = load_actor(tiny_model_dir, attn_implementation="sdpa")
    result = run_case(model, 1, 12, 5, 1, torch.device("cpu"))  # raises where the layouts disagree
    assert set(result["figures"]) == set(SIDES)
    assert all(
        set(f) == {"frozen_s", "update_s", "frozen_mib", "update_mib"} for f in result["figures"].values()
    )
    assert result["max_log_prob_difference"] <= result["tolerance"]
    assert result["tokens"] == {"padded": GROUP * 17, "packed": GROUP * 17, "shared": 12 + GROUP * 5}
