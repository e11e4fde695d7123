"""The live vLLM PD stack on this CPU: a prefill and decodes reading KV over NIXL with pdwatch's adapter
inside, behind the testbed's PD proxy (test infrastructure: ../../docs/vllm.md#the-live-testbed)."""
