"""Speculative decoding (ngram) on the CPU: the state ring's invariant, and greedy tokens with drafts equal to
the float64 recurrence and to the same engine without drafts, with drafts rejected and accepted.

Each engine with drafts runs in a process of its own (tests/engine_runner.py says why)."""

import math
import os
import random

import pytest
import torch

from conftest import run_engines
from grid import divergences
from oracle import RecurrentMamba2, oracle_generate

from vllm_mamba2_plugin import tiny_model
from vllm_mamba2_plugin.spec_decode import prefill_ring, verify_positions

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize("ring, block_size", [(2, 0), (4, 0), (6, 0), (2, 4), (4, 8), (3, 6), (6, 12)])
def test_every_step_reads_the_state_after_its_last_computed_token(ring, block_size):
    """Runs the builder's plans of random steps on labels: each slot holds "the state after position p". A verified
    position must find position - 1's state in its source slot; a prefill row must find its context's last state
    in its initial slot (when it resumes) and leaves a state at every one of its tokens when it is short enough to
    carry drafts. Rejection keeps a random prefix of a short row, so the next step reads another column. With
    prefix caching (block_size) every completed block keeps its boundary's state, and no step writes a block
    before the one of its first read."""
    rng = random.Random(ring * 100 + block_size)
    R, steps = 5, 60
    columns = steps * 3 * ring // block_size + ring + 1 if block_size else ring
    table = torch.arange(R * columns).view(R, columns) + 100  # distinct slot ids
    label = {}  # slot -> position whose state it holds
    context = [0] * R

    def write(r, slot, p):
        if block_size:
            assert int(slot) - 100 - r * columns >= max(context[r] - 1, 0) // block_size, "a block before the read"
        label[int(slot)] = p

    for step in range(steps):
        q = [rng.randint(1, ring) if rng.random() < 0.8 else rng.randint(ring + 1, 3 * ring) for _ in range(R)]
        verified = [c > 0 and k <= ring and rng.random() < 0.7 for c, k in zip(context, q)]
        rows_v = [r for r in range(R) if verified[r]]
        cu = torch.tensor([0] + [q[r] for r in rows_v]).cumsum(0)
        seen = {}
        for pos in verify_positions(table[rows_v], cu, torch.tensor([context[r] for r in rows_v]), ring, block_size):
            for tok, s, d in zip(pos.tokens.tolist(), pos.src.tolist(), pos.dst.tolist()):
                i = int(torch.searchsorted(cu, tok, right=True)) - 1
                r, p = rows_v[i], context[rows_v[i]] + tok - int(cu[i])
                assert label[s] == p - 1, (step, r, p, label[s])
                assert seen.get(r, context[r] - 1) == p - 1, "positions of a row out of order"
                seen[r] = p
                write(r, d, p)  # the copy, then the update in place
        assert all(seen[r] == context[r] + q[r] - 1 for r in rows_v)
        rows_p = [r for r in range(R) if not verified[r]]
        ring_p = prefill_ring(table[rows_p], torch.tensor([context[r] for r in rows_p]),
                              torch.tensor([q[r] for r in rows_p]), ring, block_size)
        boundary = iter(ring_p.boundary_slots.tolist() if ring_p.boundary_slots is not None else [])
        for i, r in enumerate(rows_p):
            if context[r]:
                assert label[int(ring_p.initial_slots[i])] == context[r] - 1
            for o in (ring_p.boundary_offsets or [[]] * len(rows_p))[i]:
                write(r, next(boundary), context[r] + o - 1)
            write(r, ring_p.slots[i], context[r] + q[r] - 1)
        assert next(boundary, None) is None
        for r in range(R):  # a row that may carry drafts keeps a prefix: the row's first token and some drafts
            context[r] += rng.randint(1, q[r]) if q[r] <= ring else q[r]
            for b in range(context[r] // block_size if block_size else 0):  # completed blocks: what a hit reads
                assert label[int(table[r, b])] == (b + 1) * block_size - 1, (step, r, b)


def repeating_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts whose tail repeats an earlier span, of lengths that chunked prefill cuts, one-token ones (vLLM pads
    a newcomer's one-token prompt with placeholder drafts), and a few random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 4 == 1:
            prompts.append([rng.randrange(3, vocab)])
        elif i % 4 == 3:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 150))])
        else:
            span = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(0, 120))] + span * rng.randint(2, 4))
    return prompts


ENGINE = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=512, disable_log_stats=False)


@pytest.mark.parametrize("name", list(tiny_model.GRID))
def test_grid_model_with_drafts_matches_recurrence(name, grid_dirs, grid_oracles):
    """Random wide weights: the drafts are mostly rejected, so most steps roll back. prompt_lookup_min 1: the
    sampled token alone, seen earlier in the context, proposes what followed it there. The requests arrive one
    every two steps, so newcomers join verification steps."""
    spec = tiny_model.GRID[name]
    prompts = repeating_prompts(spec.vocab_size, 12, spec.seed)
    ngram = {**NGRAM, "prompt_lookup_min": 1}
    [result] = run_engines([dict(model=grid_dirs[name], prompts=prompts, max_tokens=16, spec_counts=True,
                                 arrive_every=2, llm_kwargs={**ENGINE, "speculative_config": ngram})])
    wrong, _ = divergences(grid_oracles[name], prompts, result["tokens"], 16)
    assert not wrong, f"{len(wrong)} of {len(prompts)} (prompt length, position, margin, got, want): {wrong[:10]}"
    assert result["spec_counts"]["spec_decode_num_draft_tokens"] > 0, result["spec_counts"]


@pytest.mark.parametrize("uniform_plan", ["1", "0"])
def test_drafts_on_every_step_roll_back_exactly(uniform_plan, grid_dirs, grid_oracles):
    """Every request gets k wrong drafts on every step, so every decode-only step is a uniform batch of 1 + k tokens
    per request, the batches FULL graphs replay: with VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS=1 (the default) they are
    planned in the graphs' persistent buffers (run eagerly on the CPU), with 0 per step. Every step keeps only its
    first token: the state must come back from the first column of each ring, step after step."""
    spec = tiny_model.GRID["n16g8"]
    prompts = repeating_prompts(spec.vocab_size, 8, spec.seed + 2)
    [result] = run_engines([dict(model=grid_dirs["n16g8"], prompts=prompts, max_tokens=16, spec_counts=True,
                                 wrong_drafts=spec.vocab_size, llm_kwargs={**ENGINE, "speculative_config": NGRAM})],
                           env={"VLLM_MAMBA2_PLUGIN_SPEC_FULL_GRAPHS": uniform_plan})
    wrong, _ = divergences(grid_oracles["n16g8"], prompts, result["tokens"], 16)
    assert not wrong, wrong
    counts = result["spec_counts"]
    assert counts["spec_decode_num_draft_tokens"] >= 3 * 8 * 10, counts  # k drafts on (nearly) every step
    assert counts["spec_decode_num_accepted_tokens"] < counts["spec_decode_num_draft_tokens"] // 10, counts


def test_every_number_of_accepted_drafts_resumes_from_its_column(grid_dirs, grid_oracles):
    """k drafts per request on every step, the first a of them the recurrence's own tokens (a cycling through
    0 .. k): uniform batches (the FULL-graph plan) whose next step reads each column of the ring in turn."""
    name = "h64n128"
    spec, oracle = tiny_model.GRID[name], grid_oracles[name]
    prompts = repeating_prompts(spec.vocab_size, 8, spec.seed + 3)
    answers = [oracle_generate(oracle, p, 16)[0] for p in prompts]
    [result] = run_engines([dict(model=grid_dirs[name], prompts=prompts, max_tokens=16, spec_counts=True,
                                 oracle_drafts={"answers": answers, "vocab": spec.vocab_size},
                                 llm_kwargs={**ENGINE, "speculative_config": NGRAM})])
    wrong, _ = divergences(oracle, prompts, result["tokens"], 16)
    assert not wrong, wrong
    counts = result["spec_counts"]
    drafted, accepted = counts["spec_decode_num_draft_tokens"], counts["spec_decode_num_accepted_tokens"]
    assert drafted >= 3 * 8 * 3 and 0.25 * drafted < accepted < 0.75 * drafted, counts


@pytest.mark.parametrize("drafts, k", [("wrong", 3), ("oracle", 2)])
def test_drafts_with_prefix_caching_hit_cached_states_and_stay_exact(drafts, k, model_dirs, oracles):
    """Prefix caching under speculation. Blocks of lcm(8, 1 + k) tokens (g1's SSD chunk, whole rings): 8 at k = 3,
    24 at k = 2, so verification steps cross block boundaries. Round 1: a prompt sharing a system prompt of 2.5
    blocks with the later ones. Round 2: those (hits at the shared blocks), and round 1's prompt with its answer
    and five more tokens (a next turn: its hit reaches blocks completed by verification steps). k drafts on every
    step: all wrong (each step keeps one token), or the first a right, a cycling through 0 .. k."""
    from conftest import random_prompts

    new, bs = 16, math.lcm(8, 1 + k)
    oracle = oracles["g1"]
    system = random_prompts([5 * bs // 2], 500, seed=5)[0]
    prompts = [system + s for s in random_prompts([3, 1, 17, 8], 500, seed=6)]
    first = oracle_generate(oracle, prompts[0], new)[0]
    turn = prompts[0] + first + random_prompts([5], 500, seed=7)[0]
    rounds = [prompts[:1], prompts[1:] + [turn]]
    run = dict(model=model_dirs["g1"], rounds=rounds, max_tokens=new, spec_counts=True,
               llm_kwargs={**ENGINE, "enable_prefix_caching": True, "max_num_batched_tokens": 16,
                           "speculative_config": {**NGRAM, "num_speculative_tokens": k}})
    if drafts == "wrong":
        run["wrong_drafts"] = 500
    else:
        run["oracle_drafts"] = {"answers": [oracle_generate(oracle, p, new)[0] for p in sum(rounds, [])],
                                "vocab": 500}
    [result] = run_engines([run])
    for prompts_r, tokens_r in zip(rounds, result["rounds"]):
        wrong, _ = divergences(oracle, prompts_r, tokens_r, new)
        assert not wrong, wrong
    hits = result["cached"][1]
    assert all(h >= 2 * bs and h % bs == 0 and h < len(p) for h, p in zip(hits, prompts[1:])), hits
    done = len(prompts[0]) + new - 1  # round 1 fed its prompt and all but its last token
    assert (done - 1 - k) // bs * bs <= hits[-1] <= done // bs * bs, (hits[-1], done)
    counts = result["spec_counts"]
    assert counts["spec_decode_num_draft_tokens"] >= k * 5 * 4, counts
    accepted = counts["spec_decode_num_accepted_tokens"]
    assert accepted < counts["spec_decode_num_draft_tokens"] // 10 if drafts == "wrong" else accepted > 0, counts


@pytest.mark.slow
def test_tensor_parallel_with_drafts_matches_recurrence(grid_dirs, grid_oracles):
    """TP = 2 (each rank its own ring of its heads' states), compiled (Dynamo): n32g4's 16 heads and 4 groups split
    in two."""
    spec = tiny_model.GRID["n32g4"]
    prompts = repeating_prompts(spec.vocab_size, 8, spec.seed + 1)
    engine = dict(ENGINE, tensor_parallel_size=2, enforce_eager=False,
                  compilation_config={"mode": 2, "backend": "eager"},
                  speculative_config={**NGRAM, "prompt_lookup_min": 1})
    [result] = run_engines([dict(model=grid_dirs["n32g4"], prompts=prompts, max_tokens=12, spec_counts=True,
                                 arrive_every=2, llm_kwargs=engine)], env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    wrong, _ = divergences(grid_oracles["n32g4"], prompts, result["tokens"], 12)
    assert not wrong, wrong
    assert result["spec_counts"]["spec_decode_num_draft_tokens"] > 0, result["spec_counts"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """The README's default model: fitted to a paragraph, so its continuations repeat text ngram drafts find."""
    return tiny_model.build(str(tmp_path_factory.mktemp("demo") / "m"), tiny_model.PRESETS["default"])


@pytest.mark.parametrize("k, ssm_state", [(1, "float32"), (3, "float32"), (3, "bfloat16")])
def test_accepted_drafts_give_the_tokens_of_plain_decoding(k, ssm_state, demo_dir):
    """With bf16 states too: a verified token goes through the decode kernels as in plain decoding, so it rounds
    its state the same way."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(demo_dir, "tokenizer.json"))
    texts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "one, two, three, four, five,",
             "Monday, Tuesday, Wednesday,", "The rain in Spain", "To be or not"]
    prompts = [tokenizer.encode(t).ids for t in texts]
    run = dict(model=demo_dir, prompts=prompts, max_tokens=48,
               llm_kwargs=dict(ENGINE, max_num_batched_tokens=32, mamba_ssm_cache_dtype=ssm_state))
    plain, spec = run_engines([run, {**run, "spec_counts": True,
                                     "llm_kwargs": {**run["llm_kwargs"],
                                                    "speculative_config": {**NGRAM, "num_speculative_tokens": k}}}])
    assert spec["tokens"] == plain["tokens"]
    counts = spec["spec_counts"]
    assert 0 < counts["spec_decode_num_accepted_tokens"] < counts["spec_decode_num_draft_tokens"], counts
    if ssm_state == "float32":
        wrong, _ = divergences(RecurrentMamba2(demo_dir), prompts, spec["tokens"], 48)
        assert not wrong, wrong
