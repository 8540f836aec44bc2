"""patches.py: prompt token ids outside the model's vocabulary are refused in the front end (a 4xx), with and
without a tokenizer, instead of reaching the engine's embedding lookup."""

from types import SimpleNamespace

import pytest

from vllm_mamba2_plugin import patches


def test_out_of_vocabulary_finds_the_offending_id():
    assert patches.out_of_vocabulary([0, 5, 511], 512) is None
    assert patches.out_of_vocabulary([5, 512], 512) == 512
    assert patches.out_of_vocabulary([-1, 5, 10**6], 512) == -1


@pytest.fixture
def patched(monkeypatch):
    """InputProcessor._validate_model_input replaced by a recorder, then the patch installed over it."""
    from vllm.v1.engine.input_processor import InputProcessor

    seen = []
    monkeypatch.setattr(InputProcessor, "_validate_model_input", lambda self, inp, *a, **kw: seen.append(inp))
    monkeypatch.setattr(patches, "_installed", set())
    patches.install()
    return InputProcessor._validate_model_input, seen


def _processor(arch):
    return SimpleNamespace(model_config=SimpleNamespace(architectures=[arch], get_vocab_size=lambda: 512))


@pytest.mark.parametrize("ids", [[5, 512], [5, 1_000_000], [-3, 5]])
def test_plugin_models_refuse_out_of_vocabulary_prompt_ids(patched, ids):
    from vllm.exceptions import VLLMValidationError

    validate, seen = patched
    with pytest.raises(VLLMValidationError, match="out of vocabulary: this model's token ids are 0..511"):
        validate(_processor("Mamba2ForCausalLM"), {"type": "token", "prompt_token_ids": ids}, "decoder")
    assert seen == []  # refused before vLLM's own checks


def test_valid_prompts_and_other_models_pass_through(patched):
    validate, seen = patched
    validate(_processor("Mamba2ForCausalLM"), {"type": "token", "prompt_token_ids": [0, 511]}, "decoder")
    validate(_processor("LlamaForCausalLM"), {"type": "token", "prompt_token_ids": [5, 10**6]}, "decoder")
    validate(_processor("Mamba2ForCausalLM"), {"type": "embeds", "prompt_embeds": None}, "decoder")
    assert len(seen) == 3


def test_install_is_idempotent(patched):
    from vllm.v1.engine.input_processor import InputProcessor

    validate, _ = patched
    patches.install()
    assert InputProcessor._validate_model_input is validate
