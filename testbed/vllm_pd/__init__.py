"""A live vLLM prefill/decode pair on this CPU, moving KV over NIXL, with pdwatch's adapter inside
(test infrastructure: ../../docs/vllm.md)."""
