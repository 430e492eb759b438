"""``make bench``: run every benchmark and write benchmarks/results.json. Never a test: figures only."""

from benchmarks import rollout_vllm
from benchmarks.results import record


def main() -> None:
    record(rollout_vllm.main())


if __name__ == "__main__":
    main()
