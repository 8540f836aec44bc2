"""mamba_ssm's own checkpoint format (state-spaces/mamba2-*; vllm_mamba2_plugin/mamba_ssm_format.py): the config read
with mamba_ssm's defaults, the vocabulary padded as MambaLMHeadModel pads it, tied embeddings, .bin and .safetensors
weights; greedy fp32 tokens equal to the HF-format copy of the same weights and to the float64 recurrence; clear
errors for what the plugin does not serve."""

import json
import math
import os

import pytest
import torch

from conftest import engine, make_llm, random_prompts
from vllm_mamba2_plugin import tiny_model
from vllm_mamba2_plugin.mamba_ssm_format import hf_config_dict, is_mamba_ssm_config
from vllm_mamba2_plugin.validation import UnsupportedOptionError

MAX_TOKENS = 8

# config.json of state-spaces/mamba2-2.7b as mamba_ssm writes it: everything else is a default.
MAMBA2_2_7B = {"d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277,
               "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
               "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
               "tie_embeddings": True}


def test_the_released_config_reads_with_mamba_ssm_defaults():
    assert is_mamba_ssm_config(MAMBA2_2_7B)
    hf = hf_config_dict(MAMBA2_2_7B)
    assert hf["vocab_size"] == 50288  # 50 277 padded to a multiple of 16
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_heads"], hf["head_dim"]) == (2560, 64, 80, 64)
    assert (hf["n_groups"], hf["state_size"], hf["conv_kernel"], hf["chunk_size"]) == (1, 128, 4, 256)
    assert (hf["use_bias"], hf["use_conv_bias"], hf["tie_word_embeddings"]) == (False, True, True)
    assert hf["time_step_limit"] == [0.0, math.inf] and hf["architectures"] == ["Mamba2ForCausalLM"]
    minimal = hf_config_dict({"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {"layer": "Mamba2"}})
    assert minimal["vocab_size"] == 50280 and minimal["tie_word_embeddings"]  # MambaConfig's defaults: 8, tied
    assert not is_mamba_ssm_config({"model_type": "mamba2", "d_model": 1, "n_layer": 1})


@pytest.mark.parametrize("change, pattern", [
    ({"ssm_cfg": {}}, "a Mamba1 checkpoint"),  # mamba_ssm's default layer is Mamba1
    ({"ssm_cfg": {"layer": "Mamba1"}}, "a Mamba1 checkpoint"),
    ({"attn_layer_idx": [3, 9]}, r"a hybrid checkpoint \(attention layers \[3, 9\]\)"),
    ({"d_intermediate": 4096}, r"MLP blocks \(d_intermediate = 4096\)"),
    ({"rms_norm": False}, "LayerNorm blocks"),
    ({"ssm_cfg": {"layer": "Mamba2", "d_ssm": 2560}}, "ssm_cfg.d_ssm = 2560"),
    ({"ssm_cfg": {"layer": "Mamba2", "D_has_hdim": True}}, "ssm_cfg.D_has_hdim = true"),
    ({"ssm_cfg": {"layer": "Mamba2", "headdim": 96}}, "not a multiple of headdim 96"),
    ({"ssm_cfg": {"layer": "Mamba2", "frobnicate": 1}}, r"ssm_cfg keys \['frobnicate'\]"),
])
def test_what_the_plugin_does_not_serve_is_refused(change, pattern):
    with pytest.raises(UnsupportedOptionError, match=pattern) as err:
        hf_config_dict({**MAMBA2_2_7B, **change})
    assert str(err.value).startswith("vllm-mamba2-plugin: ")


def _export(model_dirs, variant, tmp_path, **kw):
    return tiny_model.export_mamba_ssm(model_dirs[variant], str(tmp_path / f"{variant}-mamba_ssm"), **kw)


def _tokens(llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("variant, export, llm_kwargs", [
    # tied embeddings, pytorch_model.bin with the tied lm_head.weight, vocabulary 500 padded to 512
    ("g2_tied", dict(weights="bin", vocab_size=500, pad_vocab_size_multiple=16), {}),
    # untied, linear biases, conv width 3, a dt limit, 8 groups; safetensors; the format named explicitly
    ("g8_bias", dict(weights="safetensors"), {"config_format": "mamba_ssm"}),
])
def test_served_tokens_equal_the_hf_copy_and_the_oracle(variant, export, llm_kwargs, model_dirs, oracles, tmp_path):
    ms_dir = _export(model_dirs, variant, tmp_path, **export)
    assert not os.path.exists(os.path.join(ms_dir, "tokenizer.json"))
    llm = make_llm(ms_dir, skip_tokenizer_init=True, max_num_batched_tokens=16, **llm_kwargs)
    hf = llm.llm_engine.vllm_config.model_config.hf_config
    assert hf.vocab_size == 512 and getattr(hf, "mamba_ssm_checkpoint", False)
    prompts = random_prompts([1, 5, 17, 40], 500, seed=3)
    got = _tokens(llm, prompts)
    assert got == _tokens(engine(model_dirs[variant]), prompts)
    assert got == [oracles[variant].generate(p, MAX_TOKENS)[0] for p in prompts]


def test_the_demo_model_exports_both_ways(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "demo"
    subprocess.run([sys.executable, "-m", "vllm_mamba2_plugin.tiny_model", str(out), "--preset", "test",
                    "--format", "mamba_ssm"], check=True, capture_output=True)
    with open(out / "config.json") as f:
        config = json.load(f)
    assert is_mamba_ssm_config(config) and config["ssm_cfg"]["layer"] == "Mamba2"
    hf_weights = tiny_model.random_weights(tiny_model.PRESETS["test"])
    ms_weights = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(ms_weights["backbone.embedding.weight"], hf_weights["backbone.embeddings.weight"])
    assert os.path.exists(out / "hf" / "config.json")


def test_a_missing_or_misshapen_tensor_is_named(model_dirs, tmp_path):
    ms_dir = _export(model_dirs, "g2_tied", tmp_path)
    path = os.path.join(ms_dir, "pytorch_model.bin")
    w = torch.load(path, weights_only=True)
    del w["backbone.layers.1.mixer.D"]
    w["backbone.layers.0.mixer.dt_bias"] = w["backbone.layers.0.mixer.dt_bias"][:-1]
    torch.save(w, path)
    with pytest.raises(Exception) as err:
        make_llm(ms_dir, skip_tokenizer_init=True)
    text = str(err.value) + "".join(map(str, err.value.__cause__ and [err.value.__cause__] or []))
    assert "backbone.layers.1.mixer.D" in text and "backbone.layers.0.mixer.dt_bias" in text, text


def test_a_mamba1_checkpoint_is_refused_at_start_up(model_dirs, tmp_path):
    ms_dir = _export(model_dirs, "g2_tied", tmp_path)
    with open(os.path.join(ms_dir, "config.json")) as f:
        config = json.load(f)
    config["ssm_cfg"].pop("layer")
    with open(os.path.join(ms_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(Exception, match="a Mamba1 checkpoint"):
        make_llm(ms_dir, skip_tokenizer_init=True)


def test_without_a_tokenizer_the_error_names_the_fix(model_dirs, tmp_path):
    ms_dir = _export(model_dirs, "g2_tied", tmp_path)
    with pytest.raises(Exception, match="without a tokenizer. Pass --tokenizer EleutherAI/gpt-neox-20b"):
        make_llm(ms_dir)
    llm = make_llm(ms_dir, tokenizer=model_dirs["g2_tied"])  # a tokenizer from elsewhere: served
    assert _tokens(llm, [[5, 6, 7]])
