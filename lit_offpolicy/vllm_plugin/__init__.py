"""What runs inside vLLM's server processes: the plugin entry point (``vllm.general_plugins``) that
registers the ``lit_offpolicy`` weight transfer backend, its receiver (TCP or shared memory), and the
wire format the trainer's sender shares. It imports nothing of the trainer (Lightning, the engines):
every vLLM process loads the plugin, so it must cost a server nothing."""
