"""A real SGLang 0.5.23 prefill/decode stack on this CPU, with pdwatch's plugin inside.

`SglangStack` starts one prefill and one or two decode servers (tiny model
with random weights, KV caches moved over NIXL on loopback) and SGLang's own
router, drives load through the router, and runs the faults of a scenario.
It has the emulated `testbed.stack.Stack`'s interface, so `pdwatch testbed
--engine sglang` and the tests drive either. What a CPU needs (the
`sgl_kernel` stand-in, the KV pool registered as DRAM, the torchvision shim)
lives in `cpu_site/`, which only these servers get on their PYTHONPATH.
"""
