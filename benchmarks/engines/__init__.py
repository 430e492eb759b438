"""Against the raw engine our layer wraps: vLLM's and transformers' own generate and weight loads, the
in-process engine for a ``vllm serve`` server, the code sandbox called once per test."""
