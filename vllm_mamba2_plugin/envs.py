"""The plugin's environment switches, read in one place.

VLLM_MAMBA2_PLUGIN_OVERRIDE   "1" (default): the plugin serves the stock HF architecture name
                              ``Mamba2ForCausalLM``. "0": vLLM's in-tree Mamba2 keeps that name, and the plugin
                              answers only to its own name (``Mamba2PluginForCausalLM``), so both can be compared
                              in one environment (``hf_overrides={"architectures": ["Mamba2PluginForCausalLM"]}``).
VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS
                              "1" (default): with CUDA graphs on, decode-only steps replay FULL CUDA graphs
                              (as vLLM's in-tree Mamba2 does; see backend.py) and mixed steps piecewise ones.
                              "0": piecewise CUDA graphs only (the mixer op runs eagerly between captured
                              pieces). Both are token-exact against the recurrence on the GPU (tests/gpu).
VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS
                              "1" (default, with FULL_DECODE_GRAPHS on): under speculative decoding, decode steps of
                              1 + k tokens per request are planned in persistent buffers and replay FULL CUDA graphs
                              (docs/speculative-decoding.md). "0": every step runs piecewise, planned per step.
VLLM_MAMBA2_PLUGIN_KERNELS    "auto" (default): the upstream CUDA kernels on CUDA tensors; on the CPU vLLM's own
                              decode ops where the installed vLLM has them (kernels/cpu.py), the plain-torch
                              reference for the rest. "reference": the reference everywhere (debugging, oracles).
VLLM_MAMBA2_PLUGIN_FAST_LAUNCH
                              "1" (default): mamba-ssm's autotuned SSD kernels are launched with their tuned
                              config without Triton's per-call autotuner bookkeeping (kernels/cuda/triton_launch.py).
                              "0": every launch goes through Triton's Autotuner.run.
VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH
                              "1" (default): under the fast launch, a kernel already compiled for a call's
                              specialisation is launched directly, without JITFunction.run's per-call binding
                              and cache-key work (kernels/cuda/triton_launch.py, DirectLaunch). "0": JITFunction.run.
VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM
                              "0" (default): on a vLLM release outside the supported ones (version_gate.py) the
                              plugin registers nothing but a refusal, and vLLM's in-tree Mamba2 serves
                              Mamba2ForCausalLM. "1": register the plugin anyway.
VLLM_MAMBA2_PLUGIN_SSD_CONFIGS
                              "extended" (default): mamba-ssm's SSD autotuners also try the configs of vLLM's
                              copies of those kernels (kernels/cuda/triton_launch.py). "upstream": mamba-ssm's lists.
"""

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: set it to 1 or 0")


def override_in_tree() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_OVERRIDE", True)


def full_decode_graphs() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_FULL_DECODE_GRAPHS", True)


def spec_full_graphs() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS", True)


def _choice(name: str, allowed: tuple) -> str:
    """One of ``allowed`` (the first is the default), case-insensitive; anything else is refused."""
    value = os.environ.get(name, allowed[0]).strip().lower() or allowed[0]
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported: use {' or '.join(repr(a) for a in allowed)}")
    return value


def kernel_choice() -> str:
    return _choice("VLLM_MAMBA2_PLUGIN_KERNELS", ("auto", "reference"))


def fast_launch() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_FAST_LAUNCH", True)


def direct_launch() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_DIRECT_LAUNCH", True)


def ssd_configs() -> str:
    return _choice("VLLM_MAMBA2_PLUGIN_SSD_CONFIGS", ("extended", "upstream"))


def unverified_vllm() -> bool:
    return _flag("VLLM_MAMBA2_PLUGIN_UNVERIFIED_VLLM", False)
