"""mamba_ssm's own checkpoint format (``state-spaces/mamba2-130m`` ... ``-2.7b``), read as an HF Mamba2 config.

Such a checkpoint is what ``MambaLMHeadModel.save_pretrained`` writes:

    config.json          {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg": {"layer": "Mamba2", ...},
                          "attn_layer_idx", "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm",
                          "pad_vocab_size_multiple", "tie_embeddings"}   -- no model_type, no architectures
    pytorch_model.bin    backbone.embedding.weight, backbone.layers.{i}.norm.weight,
    (or *.safetensors)   backbone.layers.{i}.mixer.{in_proj.weight, conv1d.weight, conv1d.bias, dt_bias, A_log, D,
                         norm.weight, out_proj.weight}, backbone.norm_f.weight, lm_head.weight

``ssm_cfg`` holds only the Mamba2 arguments that differ from their defaults (``MAMBA2_DEFAULTS``). The mixer's
weights have the HF names already; ``Mamba2PluginForCausalLM.load_weights`` maps the embedding's name. The vocabulary
is padded up to a multiple of ``pad_vocab_size_multiple``, as ``MambaLMHeadModel`` pads its embedding.

vLLM reads it through a config parser (``MambaSsmConfigParser``, format "mamba_ssm"); with vLLM's default
``--config-format auto`` a config.json means "hf", so ``register()`` also puts ``HFOrMambaSsmConfigParser`` in the
"hf" slot: it hands such a config.json to the mamba_ssm parser and everything else to vLLM's own (patches.py, 2).
"""

import math
import os

from .errors import ERROR_PREFIX, UnsupportedOptionError

FORMAT = "mamba_ssm"
MARKER = "mamba_ssm_checkpoint"  # set on configs read from this format (tokenizer check, validation.py)

# mamba_ssm.modules.mamba2.Mamba2's defaults for the arguments that change what the model computes.
MAMBA2_DEFAULTS = dict(d_state=128, d_conv=4, expand=2, headdim=64, d_ssm=None, ngroups=1, rmsnorm=True,
                       norm_before_gate=False, D_has_hdim=False, dt_limit=(0.0, math.inf), bias=False,
                       conv_bias=True, chunk_size=256, activation="swish")
# Arguments that only shape the initialisation or the training path: no effect on inference.
INIT_ONLY = {"A_init_range", "dt_min", "dt_max", "dt_init_floor", "conv_init", "use_mem_eff_path", "layer_idx",
             "sequence_parallel", "process_group", "device", "dtype"}
# MambaConfig's defaults (mamba_ssm.models.config_mamba) for the top-level keys a config.json may omit.
MODEL_DEFAULTS = dict(d_intermediate=0, attn_layer_idx=[], rms_norm=True, residual_in_fp32=True,
                      pad_vocab_size_multiple=8, tie_embeddings=True)
NORM_EPS = 1e-5  # mamba_ssm's block norms and gated norm (not in its config)


def is_mamba_ssm_config(config: dict) -> bool:
    return "model_type" not in config and "architectures" not in config and {"d_model", "n_layer"} <= set(config)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """MambaLMHeadModel's embedding rows: vocab_size rounded up to a multiple of pad_vocab_size_multiple."""
    return -(-vocab_size // multiple) * multiple if multiple > 1 else vocab_size


def _refuse(what: str, fix: str):
    raise UnsupportedOptionError(f"{ERROR_PREFIX}: {what}. {fix}")


def _ssm_args(config: dict) -> dict:
    ssm_cfg = dict(config.get("ssm_cfg") or {})
    layer = ssm_cfg.pop("layer", "Mamba1")
    if layer != "Mamba2":
        _refuse(f"a {layer} checkpoint (ssm_cfg.layer = {layer!r}; mamba_ssm's default is Mamba1) is not a Mamba2 "
                "model", "Serve Mamba1 checkpoints with vLLM's in-tree MambaForCausalLM (an HF-format conversion).")
    unknown = sorted(set(ssm_cfg) - set(MAMBA2_DEFAULTS) - INIT_ONLY)
    if unknown:
        _refuse(f"ssm_cfg keys {unknown} are not Mamba2 arguments the plugin knows", "Remove them from config.json.")
    return {**MAMBA2_DEFAULTS, **{k: v for k, v in ssm_cfg.items() if k in MAMBA2_DEFAULTS}}


def _check_supported(top: dict, ssm: dict, d_inner: int) -> None:
    if top["attn_layer_idx"]:
        _refuse(f"a hybrid checkpoint (attention layers {top['attn_layer_idx']}) is not supported",
                "The plugin serves pure Mamba2 models.")
    if top["d_intermediate"]:
        _refuse(f"MLP blocks (d_intermediate = {top['d_intermediate']}) are not supported",
                "The plugin serves Mamba2 blocks without MLPs (d_intermediate 0).")
    if not top["rms_norm"]:
        _refuse("LayerNorm blocks (rms_norm = false) are not supported", "The plugin's blocks use RMSNorm.")
    if ssm["d_ssm"] not in (None, d_inner):
        _refuse(f"ssm_cfg.d_ssm = {ssm['d_ssm']} (only part of the {d_inner} channels through the SSM) is not "
                "supported", "Use d_ssm = expand * d_model.")
    if ssm["D_has_hdim"]:
        _refuse("ssm_cfg.D_has_hdim = true (a D per channel) is not supported", "The plugin keeps one D per head.")
    if d_inner % ssm["headdim"]:
        _refuse(f"expand * d_model = {d_inner} is not a multiple of headdim {ssm['headdim']}", "Fix config.json.")


def hf_config_dict(config: dict) -> dict:
    """The HF Mamba2Config fields of a mamba_ssm config.json (refusing what the plugin does not compute)."""
    top = {**MODEL_DEFAULTS, **config}
    ssm = _ssm_args(config)
    d_inner = int(ssm["expand"] * top["d_model"])
    _check_supported(top, ssm, d_inner)
    lo, hi = ssm["dt_limit"]
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", MARKER: True,
        "hidden_size": top["d_model"], "num_hidden_layers": top["n_layer"],
        "vocab_size": padded_vocab(top["vocab_size"], top["pad_vocab_size_multiple"]),
        "num_heads": d_inner // ssm["headdim"], "head_dim": ssm["headdim"], "expand": ssm["expand"],
        "n_groups": ssm["ngroups"], "state_size": ssm["d_state"], "conv_kernel": ssm["d_conv"],
        "chunk_size": ssm["chunk_size"], "use_bias": ssm["bias"], "use_conv_bias": ssm["conv_bias"],
        "hidden_act": "silu" if ssm["activation"] in ("silu", "swish") else ssm["activation"],
        "rms_norm": ssm["rmsnorm"], "norm_before_gate": ssm["norm_before_gate"],
        "time_step_limit": [float(lo), float(hi)], "layer_norm_epsilon": NORM_EPS,
        "residual_in_fp32": top["residual_in_fp32"], "tie_word_embeddings": top["tie_embeddings"],
        # The GPT-NeoX-20B tokenizer of the released checkpoints: <|endoftext|> = 0, <|padding|> = 1.
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1,
    }


def read_config_json(model, revision=None) -> dict | None:
    """config.json of a local directory or a Hub repository (None if there is none)."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    return get_hf_file_to_dict("config.json", str(model), revision)


def parser_classes():
    """(MambaSsmConfigParser, HFOrMambaSsmConfigParser), built on this vLLM's parser classes."""
    from transformers import Mamba2Config
    from vllm.transformers_utils.config import HFConfigParser
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    class MambaSsmConfigParser(ConfigParserBase):
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            raw = read_config_json(model, revision)
            if raw is None or not is_mamba_ssm_config(raw):
                raise ValueError(f"{ERROR_PREFIX}: {model} has no mamba_ssm config.json (d_model, n_layer, ssm_cfg; "
                                 "no model_type)")
            hf = hf_config_dict(raw)
            return hf, Mamba2Config(name_or_path=str(model), **hf)

    class HFOrMambaSsmConfigParser(HFConfigParser):
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            raw = read_config_json(model, revision)
            if raw is not None and is_mamba_ssm_config(raw):
                return MambaSsmConfigParser().parse(model, trust_remote_code, revision, code_revision, **kwargs)
            return super().parse(model, trust_remote_code, revision, code_revision, **kwargs)

    return MambaSsmConfigParser, HFOrMambaSsmConfigParser


def tokenizer_problem(model_config) -> str | None:
    """A checkpoint of this format without a tokenizer of its own, served with one from its directory."""
    hf = model_config.hf_config
    if not getattr(hf, MARKER, False) or model_config.skip_tokenizer_init:
        return None
    tok = str(model_config.tokenizer)
    if not os.path.isdir(tok):
        return None
    if any(os.path.exists(os.path.join(tok, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    return (f"{ERROR_PREFIX}: {tok} is a mamba_ssm checkpoint without a tokenizer. Pass --tokenizer "
            "EleutherAI/gpt-neox-20b (the tokenizer of the state-spaces Mamba2 models) or a local copy of it, or "
            "--skip-tokenizer-init to send token ids.")
