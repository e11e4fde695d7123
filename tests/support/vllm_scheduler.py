"""vLLM's own Scheduler with the adapter's NixlConnector in it, as the adapter's tests and
bench/vllm_hook_cost.py build it (vLLM's environment only: it imports vLLM and torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdwatch.testbed.sglang_pd.model import write_model

BLOCK = 16
CONNECTOR_MODULE = "pdwatch.engine_patches.vllm.connector"


def build_scheduler(folder: Path, kv_role: str) -> Any:
    """A Scheduler for the tiny model in `folder`, 64 KV blocks, the adapter's connector in `kv_role`."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = write_model(folder / "model")
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_buffer_device="cpu",
                                            kv_connector_module_path=CONNECTOR_MODULE),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = 64
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=False,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
