"""Shared test setup: environment for in-process vLLM on CPU, tiny checkpoints, the recurrence oracle.

vLLM engines are expensive (seconds each), so tests share one engine per (model, engine options) through
``engine(...)``, which caches LLM objects for the whole session and keeps at most a few alive.
"""

import gc
import json
import os
import subprocess
import sys

# Before vLLM is imported anywhere: in-process engine core (3x faster to start), small CPU cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from oracle import RecurrentMamba2  # noqa: E402

from vllm_mamba2_plugin import tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


# scripts/test.sh runs two pytest-xdist workers, each taking whole files in collection order
# (--dist loadfile --no-loadscope-reorder). The files that start many engines or servers go first, longest
# first, so that both workers end together rather than one running the last long file alone.
LONGEST_FILES = ("test_parallel.py", "scripts/test_serve_load.py", "test_spec_decode.py", "test_other_releases.py",
                 "examples/test_examples.py", "benchmarks/test_serve_grid.py", "test_register.py", "test_model.py")


def _file_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return next((i for i, name in enumerate(LONGEST_FILES) if path.endswith(name)), len(LONGEST_FILES))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: the other files keep their order
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-test.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """On the GPU machine a step can hit its time limit before pytest's summary prints the tracebacks: with
    MAMBA2_TESTS_INSTAFAIL=1 each failure is printed (to stderr, uncaptured) the moment it happens, and so is
    the duration of every setup / call phase over a second."""
    if os.environ.get("MAMBA2_TESTS_INSTAFAIL") != "1":
        return
    if report.failed:
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
    if report.when != "teardown" and report.duration > 1.0:  # where a time-limited step's minutes went
        sys.stderr.write(f"\n--- {report.nodeid} {report.when}: {report.duration:.1f}s\n")
    sys.stderr.flush()


# Tiny model variants: vary n_groups, chunk_size, head_dim, conv width/bias, biases, tied embeddings.
MODEL_VARIANTS = {
    "g1": dict(n_groups=1, chunk_size=8, num_heads=8, head_dim=16, conv_kernel=4, use_conv_bias=True,
               tie_word_embeddings=False, seed=11),
    "g2_tied": dict(n_groups=2, chunk_size=16, num_heads=16, head_dim=8, conv_kernel=4, use_conv_bias=False,
                    tie_word_embeddings=True, seed=22),
    "g8_bias": dict(n_groups=8, chunk_size=4, num_heads=8, head_dim=32, hidden_size=128, conv_kernel=3,
                    use_conv_bias=True, use_bias=True, time_step_limit=(0.0, 0.2), seed=33),
}


def build_models(root, variants: dict) -> dict:
    """{name: checkpoint directory} of tiny models built under root, one per variant's spec keywords."""
    return {name: tiny_model.build(str(root / name), tiny_model.TinyMamba2Spec(**kw)) for name, kw in variants.items()}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("models"), MODEL_VARIANTS)


@pytest.fixture(scope="session")
def oracles(model_dirs):
    return {name: RecurrentMamba2(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="session")
def grid_dirs(tmp_path_factory):
    """The model grid's checkpoints (tiny_model.GRID), built once per session."""
    root = tmp_path_factory.mktemp("grid")
    return {name: tiny_model.build(str(root / name), spec) for name, spec in tiny_model.GRID.items()}


@pytest.fixture(scope="session")
def grid_oracles(grid_dirs):
    return {name: RecurrentMamba2(path) for name, path in grid_dirs.items()}


_ENGINES: dict = {}
_MAX_LIVE = 2


_CUDA_ENGINES: list = []


def make_llm(model_dir: str, **kwargs):
    """An fp32 eager engine with small limits. On CUDA each takes 4 % of the GPU (tiny models) and is kept alive
    for the whole session: a released in-process engine's memory goes back to the driver only when a later
    engine's start-up empties the CUDA cache, and if that lands inside the later engine's memory profiling vLLM
    0.26 aborts ("Error in memory profiling ... free memory" rose)."""
    from vllm import LLM

    opts = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
    if HAS_CUDA:
        opts["gpu_memory_utilization"] = 0.04
        torch.cuda.empty_cache()  # earlier engines' freed temporaries go back before this one's snapshot
    opts.update(kwargs)
    llm = LLM(model=model_dir, **opts)
    if HAS_CUDA:
        _CUDA_ENGINES.append(llm)
    return llm


def engine(model_dir: str, **kwargs):
    """A cached LLM for (model, options); evicts the oldest so that at most _MAX_LIVE are alive."""
    key = (model_dir, tuple(sorted(kwargs.items())))
    if key not in _ENGINES:
        while len(_ENGINES) >= _MAX_LIVE:
            _ENGINES.pop(next(iter(_ENGINES)))
            gc.collect()
        _ENGINES[key] = make_llm(model_dir, **kwargs)
    return _ENGINES[key]


def run_engines(runs: list, env: dict = None, timeout: float = 900) -> list:
    """``tests/engine_runner.py`` in a fresh process: the result of each of ``runs``. env: variables to set in its
    environment (None removes one)."""
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "engine_runner.py"),
                           json.dumps({"runs": runs})], capture_output=True, text=True, timeout=timeout, env=environ)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def free_engines():
    _ENGINES.clear()
    gc.collect()


def prompt_lengths(chunk: int) -> list[int]:
    """1, chunk-1, chunk, chunk+1, several chunks and not a multiple."""
    return sorted({1, max(1, chunk - 1), chunk, chunk + 1, 3 * chunk + 2})


def top5_containment(oracle, prompts, outs, n_tokens: int) -> int:
    """check_logprobs_close-style comparison of sampled outputs (requested with logprobs=5) with the oracle: where
    the greedy tokens first differ, each side's token must be in the other's top-5; the sequences are not
    compared after that. Returns how many leading tokens matched, over all prompts."""
    from oracle import oracle_generate

    matched = 0
    for prompt, out in zip(prompts, outs):
        want, _, step_lps = oracle_generate(oracle, prompt, n_tokens)
        got = list(out.outputs[0].token_ids)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                assert g in step_lps[i].topk(5).indices.tolist(), (len(prompt), i)
                assert w in out.outputs[0].logprobs[i], (len(prompt), i)
                break
            matched += 1
    return matched


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
