"""Test infrastructure: a stand-in for `sgl_kernel` in pdwatch's CPU testbed.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports two CPU kernels from
`sgl_kernel` at load time; the wheel on PyPI is built for CUDA. These two are
written in plain torch; any other name a new dependency shows up as
a clear error rather than a wrong result:
it imports, and raises NotImplementedError when called. With no `torch.ops.sgl_kernel`
registered, SGLang's AMX probe answers False and every layer runs its native
torch path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Row req_pool_indices[i] of req_to_token gets out_cache_loc's i-th run at [start, end)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every KV buffer (base address, row size in bytes) copy row src_loc[j] to tgt_loc[j]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str) -> Callable[..., NoReturn]:
    """Any other kernel imports (SGLang imports some it never calls on this path) but raises when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in in pdwatch's testbed")

    missing.__name__ = name
    return missing


__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]
