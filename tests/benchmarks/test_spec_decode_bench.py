"""The speculative-decoding benchmark's pure parts (benchmarks/spec_decode.py): its prompts, the acceptance from
vLLM's counters, and the table's verdict on tokens, checked against hand-made values (no engine)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import spec_decode  # noqa: E402


def test_repetitive_prompts_repeat_their_span_with_few_edits_and_random_ones_do_not():
    vocab, span = 50000, spec_decode.SPAN
    rep = spec_decode.make_prompts("repetitive", 3, 8 * span, vocab)
    assert rep == spec_decode.make_prompts("repetitive", 3, 8 * span, vocab)  # every config gets the same prompts
    for p in rep:
        assert len(p) == 8 * span and all(10 <= t < vocab for t in p)
        # each repetition changes 1-2 positions of the span: neighbours differ in at most 4
        assert sum(a == b for a, b in zip(p, p[span:])) >= 7 * (span - 4)
    rand = spec_decode.make_prompts("random", 3, 8 * span, vocab)
    assert all(sum(a == b for a, b in zip(p, p[span:])) < 5 for p in rand)
    assert len({tuple(p) for p in rep}) == 3  # a span per request


def test_acceptance_is_the_counters_delta_over_the_timed_run():
    before = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 12,
              "spec_decode_num_accepted_tokens_per_pos": [6, 4, 2]}
    after = {"spec_decode_num_drafts": 30, "spec_decode_num_draft_tokens": 90, "spec_decode_num_accepted_tokens": 57,
             "spec_decode_num_accepted_tokens_per_pos": [26, 19, 12]}
    got = spec_decode.acceptance(before, after)
    assert got["spec"]["spec_decode_num_accepted_tokens_per_pos"] == [20, 15, 10]
    assert got["acceptance_rate"] == pytest.approx(45 / 60)
    assert got["accepted_per_draft"] == pytest.approx(45 / 20)
    assert spec_decode.acceptance({}, {}) == {}  # a config without drafts reports none


def test_the_table_says_whether_tokens_with_drafts_equal_those_without():
    row = dict(model="m", mode="graph", workload="random", batch=1, out_tok_s=100.0, steps=64, tokens_sha1="a")
    rows = [dict(row, config="plugin"), dict(row, config="plugin-spec", out_tok_s=180.0, steps=30,
                                             acceptance_rate=0.5, accepted_per_draft=1.5),
            dict(row, config="plugin-spec-miss", out_tok_s=90.0, tokens_sha1="b", acceptance_rate=0.0,
                 accepted_per_draft=0.0)]
    text = spec_decode.table(rows, "m", "graph")
    line = next(t for t in text.splitlines() if t.startswith("| random"))
    assert "| 1.80 | 50.0% | 1.50 | 64 / 30 | yes |" in line and "| 0.90 | 0.0% | 0.00 | 64 / 64 | no |" in line
