"""The distribution as a user installs it: sdist and wheel built from this tree, the wheel installed
into a fresh virtual environment (no checkout on its path) beside SGLang's pinned wheel.

- the wheel holds one namespace, `pdwatch`, its data files, its extras and the SGLang entry point;
- the engine side alone records spans, and a command whose extra is missing names the extra;
- `pdwatch[sidecar]` pulls in everything `pdwatch serve` imports: it answers /healthz and ingests;
- SGLang's own `load_plugins()` finds the plugin in that environment and registers every hook.

Slow (a fresh environment, SGLang's pinned packages from the pip cache): a few minutes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest
from packaging.specifiers import SpecifierSet

from pdwatch.testbed.processes import free_port
from tests.support.sidecar import Engine, FakeClock
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.packaging]

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "packaging"
LOCK = ROOT / "requirements.lock"  # every extra pinned together (`make lock`)
PB = {"Content-Type": "application/x-protobuf"}


def run(*cmd, env=None, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def dist() -> tuple[Path, Path]:
    out = BUILD / "dist"
    shutil.rmtree(out, ignore_errors=True)
    # The sdist first, then the wheel from the sdist: what the sdist lacks, the wheel lacks too.
    # From a folder of its own: setuptools stages the sdist tree in the working directory.
    out.mkdir(parents=True)
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT, cwd=out)
    (sdist,) = out.glob("pdwatch-*.tar.gz")
    (wheel,) = out.glob("pdwatch-*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def constraints() -> Path:
    """The repository's lock, as pip constraints: what resolves is what the tests ran with."""
    return LOCK


@pytest.fixture(scope="module")
def venv(dist) -> Path:
    """A fresh environment; commands run from an empty folder, so no checkout is on sys.path."""
    path = BUILD / "venv"
    shutil.rmtree(path, ignore_errors=True)
    run(sys.executable, "-m", "venv", path)
    return path


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDWATCH_", "PYTHONPATH", "VIRTUAL_ENV"))}
    return env


def pip(venv: Path, *args) -> None:
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", *args, env=clean_env())


def test_the_wheel_is_one_namespace_with_its_data_extras_and_plugin_entry_point(dist):
    sdist, wheel = dist
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        meta = Parser().parsestr(whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
        entry_points = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"pdwatch", f"pdwatch-{meta['Version']}.dist-info"}, tops  # no sidecar/, testbed/ ...
    for path in ("pdwatch/contract/__init__.py", "pdwatch/engine_patches/sglang/hooks.py",
                 "pdwatch/sidecar/judge.py", "pdwatch/alerts/pdwatch-alerts.yml",
                 "pdwatch/dashboards/generated/stuck-requests.json",
                 "pdwatch/testbed/sglang_pd/cpu_site/pdwatch_testbed_cpu.py",
                 "pdwatch/testbed/sglang_pd/cpu_site/pdwatch_testbed_cpu-0.dist-info/entry_points.txt"):
        assert path in names, path
    assert SpecifierSet(meta["Requires-Python"]) == SpecifierSet(">=3.10,<3.14")
    base = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(re.split(r"[<>=!; ]", r)[0] for r in base) == [
        "opentelemetry-api", "opentelemetry-proto", "opentelemetry-sdk", "packaging", "protobuf"]
    assert {"sidecar", "gpu", "capture", "dashboards", "report", "testbed"} <= set(meta.get_all("Provides-Extra"))
    assert "[sglang.srt.plugins]\npdwatch = pdwatch.engine_patches.sglang:plugin" in entry_points
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "sidecar/app.py", "contract/__init__.py"} <= members


def test_the_engine_side_alone_records_and_a_command_names_its_missing_extra(venv, dist, constraints, tmp_path):
    _sdist, wheel = dist
    pip(venv, wheel, "-c", constraints)
    code = ("import pdwatch, pdwatch.engine_patches.recorder as r; "
            "from pdwatch.engine_patches.otlp_http import MemoryTransport as M; "
            "t = M(); rec = r.Recorder(r.RecorderConfig(role='decode', instance='d-0'), transport=t, environ={}); "
            "rec.arrive('d-1', bootstrap_room=1); rec.enter('d-1', 'bootstrap'); rec.heartbeat(); rec.flush(); "
            "print(pdwatch.__file__, sum(len(ss.spans) for q in t.requests() for rs in q.resource_spans "
            "for ss in rs.scope_spans))")
    out = run(venv / "bin" / "python", "-c", code, env=clean_env(), cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(venv)) and int(out[1]) >= 1  # from the fresh environment, not the checkout
    serve = subprocess.run([venv / "bin" / "pdwatch", "serve"], capture_output=True, text=True, env=clean_env(),
                           cwd=tmp_path, timeout=60)
    assert serve.returncode == 2 and "pip install 'pdwatch[sidecar]'" in serve.stderr, serve.stderr[-2000:]


def test_the_sidecar_extra_brings_what_pdwatch_serve_imports(venv, dist, constraints, tmp_path):
    _sdist, wheel = dist
    pip(venv, f"{wheel}[sidecar,gpu,capture]", "-c", constraints)
    port = free_port()
    env = {**clean_env(), "PDWATCH_NVML": "off", "PDWATCH_EVALUATE_INTERVAL_S": "0.1"}
    proc = subprocess.Popen([venv / "bin" / "pdwatch", "serve", "--port", str(port)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60,
                        ignore=(httpx.HTTPError,)), proc.stdout.read() if proc.poll() is not None else "no answer"
        clock = FakeClock(time.time_ns())
        engine = Engine("prefill", "prefill-0", clock)
        engine.walk("p-1", 7, ("bootstrap", "queued"))
        body = engine.request(heartbeat=True).SerializeToString()
        engine.rec.shutdown(timeout_s=1)
        assert httpx.post(f"{url}/v1/traces", content=body, headers=PB).status_code == 200
        summary = wait_for(lambda: httpx.get(f"{url}/api/v1/summary").json()["tracked_legs"] == 1 and
                           httpx.get(f"{url}/api/v1/summary").json(), 20)
        assert summary and [i["pd_instance"] for i in summary["instances"]] == ["prefill-0"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_sglangs_load_plugins_finds_the_plugin_in_the_installed_wheel(venv, dist, tmp_path):
    # SGLang's pinned wheel and what it imports, as `make` installs the lock (--no-deps, no resolution:
    # sglang's own dependency list pulls CUDA builds); then SGLang's loader in a fresh process.
    pip(venv, "--no-deps", "-r", LOCK)
    code = (
        "import json, sys, types\n"
        "for name in ('torchvision._meta_registrations', 'torchvision._autograd_registrations'):\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "from importlib.metadata import entry_points\n"
        "eps = [(e.name, e.value) for e in entry_points(group='sglang.srt.plugins')]\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import pdwatch.engine_patches.sglang as plugin\n"
        "from pdwatch.engine_patches.sglang.targets import TARGETS\n"
        "print(json.dumps({'eps': eps, 'status': plugin.status, 'problems': plugin.problems,\n"
        "                  'file': plugin.__file__, 'targets': len(TARGETS)}))\n"
    )
    # Not SGLang's CPU engine mode: that imports sgl_kernel at load, which only the testbed's CPU stand-in
    # provides; a serving environment has the real one. The plugin's targets import without it.
    env = {**clean_env(), "PDWATCH_SGLANG": "1", "SGLANG_PLUGINS": "pdwatch"}
    out = json.loads(run(venv / "bin" / "python", "-c", code, env=env, cwd=tmp_path, timeout=600).stdout.splitlines()[-1])
    assert out["eps"] == [["pdwatch", "pdwatch.engine_patches.sglang:plugin"]], out
    assert out["file"].startswith(str(venv)), out["file"]
    assert out["status"] == "registered" and out["problems"] == [], out
