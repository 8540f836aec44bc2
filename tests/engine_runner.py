"""Runs vLLM engines in a fresh process and prints what they produced as one JSON line.

Used where a test needs a different process environment (VLLM_PLUGINS, VLLM_MAMBA2_PLUGIN_OVERRIDE): vLLM
loads plugins once per process, so switching them needs a new one.

    python tests/engine_runner.py '{"runs": [{"model": DIR, "prompts": [[1,2,3]], "max_tokens": 8,
                                              "llm_kwargs": {"hf_overrides": {...}}}]}'
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(sys.argv[1])
    results = []
    for run in request["runs"]:
        kwargs = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
        kwargs.update(run.get("llm_kwargs", {}))
        llm = LLM(model=run["model"], **kwargs)
        cls = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
        params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]], params, use_tqdm=False)
        results.append({"model_class": cls, "tokens": [list(o.outputs[0].token_ids) for o in outs]})
        del llm
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
