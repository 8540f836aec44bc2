"""The scheduler side on vLLM releases that no machine here runs whole (0.33 and 0.34 need torch 2.14): their own
``Scheduler``, block pool and ``MambaManager`` base, from the released sources (the sdist's Python, downloaded once
into a cache), with the plugin's state spec, cache manager and prefill-chunk patch. The manager's block-id tests
pass there, and every workload of ``benchmarks/schedule_steps.py`` (prefix-cache hits, misses, both; caching off
and on) plans the same steps as on the installed vLLM. Skipped where the package index cannot be reached.

The version gate keeps the plugin off these releases (README, tested versions): the tests force it with
``VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM=1``.
"""

import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = ["0.33.0", "0.34.0"]
INDEX = "https://pypi.org/simple/vllm/"
sys.path.insert(0, os.path.join(ROOT, "tests", "benchmarks"))
from test_schedule_steps import TINY  # noqa: E402  (the tiny shape and workload of the scheduler tests)


def release_sources(version: str) -> str:
    """A directory holding vLLM ``version``'s ``vllm/`` package from its sdist (downloaded once)."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "vllm-mamba2-plugin", f"vllm-{version}")
    if os.path.exists(os.path.join(cache, "vllm", "_version.py")):
        return cache
    try:
        with urllib.request.urlopen(INDEX, timeout=30) as r:
            page = r.read().decode()
        url = re.search(rf'href="([^"#]*/vllm-{re.escape(version)}\.tar\.gz)', page).group(1)
        archive = cache + ".tar.gz"
        os.makedirs(os.path.dirname(archive), exist_ok=True)
        urllib.request.urlretrieve(url, archive)
    except (OSError, AttributeError) as e:
        pytest.skip(f"vLLM {version}'s sources could not be fetched: {e!r}")
    prefix = f"vllm-{version}/vllm/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for m in members:
            m.name = m.name[len(f"vllm-{version}/"):]
        tar.extractall(cache + ".part", members=members, filter="data")
    os.rename(cache + ".part", cache)
    os.remove(archive)
    return cache


def run_under(version: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": release_sources(version), "VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM": "1"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


PLAN_ALL = """
import json, sys
sys.path.insert(0, "benchmarks")
import schedule_steps, vllm
args = {args!r}
print("VLLM", vllm.__version__, vllm.__file__)
for workload in ("hits", "misses", "mixed"):
    for row in schedule_steps.measure(schedule_steps.parser().parse_args(args + ["--workload", workload])):
        print("ROW", json.dumps(row))
"""


def plans(version: str | None) -> list:
    """schedule_steps' rows for every workload under ``version`` (None: the installed vLLM), without the version."""
    script = PLAN_ALL.format(args=TINY)
    proc = (run_under(version, "-c", script) if version else
            subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    used = next(line for line in lines if line.startswith("VLLM "))
    assert version is None or (used.split()[1] == version and "site-packages" not in used), used
    rows = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
    for row in rows:
        row.pop("vllm")
    return rows


@pytest.fixture(scope="module")
def installed_plans():
    return plans(None)


@pytest.mark.parametrize("version", RELEASES)
def test_the_manager_tests_pass_on_the_release(version):
    proc = run_under(version, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_spec_manager.py")
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("version", RELEASES)
def test_every_workload_plans_the_same_steps_as_on_the_installed_vllm(version, installed_plans):
    assert len(installed_plans) == 6 and any(row["caching"] for row in installed_plans)
    assert plans(version) == installed_plans
