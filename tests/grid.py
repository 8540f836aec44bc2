"""The model grid's engine checks, shared by the CPU test (tests/test_grid_models.py) and the GPU one
(tests/gpu/test_grid_gpu.py): prompts of every length class, and greedy outputs against the float64 recurrence
with the recurrence's top-1 / top-2 logit margin at the first divergence.

The grid itself is ``tiny_model.GRID``: "wide" weights (step sizes up to a dt limit or past 3, peaky logits) over
the shapes a bug may depend on.
"""

from __future__ import annotations

import random

from oracle import RecurrentMamba2, oracle_generate

# A divergence where the recurrence's top two logits are closer than this is numerics (fp32 against float64),
# not a bug; it ends the comparison of that output.
TIE_MARGIN = 5e-3


def grid_prompts(vocab: int, chunk: int, n: int, seed: int, max_len: int = 408) -> list[list[int]]:
    """n prompts: an eighth of 1-3 tokens, the rest 5..max_len with the chunk's edges (chunk - 1, chunk,
    chunk + 1, 2 * chunk + 5) among them."""
    rng = random.Random(seed)
    edges = [c for c in (chunk - 1, chunk, chunk + 1, 2 * chunk + 5) if 5 <= c <= max_len]
    lengths = []
    for i in range(n):
        if i % 8 == 0:
            lengths.append(rng.randint(1, 3))
        elif i % 8 == 1 and edges:
            lengths.append(edges[(i // 8) % len(edges)])
        else:
            lengths.append(rng.randint(5, max_len))
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths]


def serve_twice(llm, prompts, max_tokens: int, seed: int) -> tuple[list, list]:
    """Every prompt twice, shuffled, in one ``generate`` (the engine batches, cuts and resumes them); every
    seventh request with n = 2 (top-k 1 sampling: vLLM refuses n > 1 with greedy). Returns (prompt, tokens) of
    every completion as two lists."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    order = list(range(len(prompts))) * 2
    random.Random(seed).shuffle(order)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                             **(dict(n=2, temperature=1.0, top_k=1) if k % 7 == 3 else dict(temperature=0.0)))
              for k in range(len(order))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in order], params, use_tqdm=False)
    got_prompts, got = [], []
    for i, out in zip(order, outs):
        for completion in out.outputs:
            got_prompts.append(prompts[i])
            got.append(list(completion.token_ids))
    return got_prompts, got


def divergences(oracle: RecurrentMamba2, prompts, outputs, max_tokens: int) -> tuple[list, int]:
    """(wrong, ties): for each output that leaves the recurrence's greedy tokens where its top-1 / top-2 margin
    is at least TIE_MARGIN, (prompt length, position, margin, got, want); and how many left it at a near-tie."""
    wrong, ties = [], 0
    for prompt, got in zip(prompts, outputs):
        want, _, step_logprobs = oracle_generate(oracle, prompt, max_tokens)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                top2 = step_logprobs[i].topk(2).values
                margin = float(top2[0] - top2[1])
                if margin < TIE_MARGIN:
                    ties += 1
                else:
                    wrong.append((len(prompt), i, round(margin, 4), g, w))
                break
        else:
            if len(got) != max_tokens:
                wrong.append((len(prompt), len(got), None, "short output", max_tokens))
    return wrong, ties
