"""Mamba2PluginForCausalLM: a causal LM over the plugin's mixer layers, reading stock HF Mamba2 checkpoints.

    embeddings -> N x [ RMSNorm -> Mamba2Mixer -> + residual ] -> RMSNorm (norm_f) -> lm_head

Checkpoint names (HF ``Mamba2ForCausalLM``; mamba-ssm's ``backbone.embedding.weight`` is accepted too):
    backbone.embeddings.weight, backbone.norm_f.weight, lm_head.weight (absent when tied)
    backbone.layers.{i}.norm.weight
    backbone.layers.{i}.mixer.{in_proj.weight, in_proj.bias?, conv1d.weight, conv1d.bias?, dt_bias,
                               A_log, D, norm.weight, out_proj.weight, out_proj.bias?}
A_log is stored as A = -exp(A_log) at load time. Missing, unknown or mis-shaped weights raise one error that
lists them; shapes are checked against the whole model's (``checkpoint_shapes``) before a tensor-parallel loader
takes this rank's part.

Pipeline parallelism (docs/parallelism.md): vLLM's ``make_layers`` builds this stage's layers and
``PPMissingLayer`` stand-ins for the others; the first stage embeds (and the last, with tied embeddings), the
last applies norm_f and the head, and the stages in between pass ``hidden_states`` / ``residual`` on as
``IntermediateTensors``.
"""

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn

from . import compat, patches
from .mixer import Mamba2Mixer
from .spec import state_shapes
from .validation import ERROR_PREFIX, check_hf_config


class Mamba2DecoderLayer(nn.Module):
    def __init__(self, config, model_config, cache_config, prefix: str):
        super().__init__()
        self.mixer = Mamba2Mixer(config, model_config, cache_config, prefix=f"{prefix}.mixer")
        self.norm = compat.RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        return self.mixer(hidden_states), residual


@compat.support_torch_compile
class Mamba2Backbone(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        pp = compat.get_pp_group()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if pp.is_first_rank or (tied and pp.is_last_rank):
            self.embeddings = compat.VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embeddings = compat.PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = compat.make_layers(
            config.num_hidden_layers,
            lambda prefix: Mamba2DecoderLayer(config, vllm_config.model_config, vllm_config.cache_config,
                                              prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm_f = (compat.RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon) if pp.is_last_rank
                       else compat.PPMissingLayer())
        self.make_empty_intermediate_tensors = compat.make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: compat.IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | compat.IntermediateTensors:
        pp = compat.get_pp_group()
        if pp.is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embeddings(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(hidden_states, residual)
        if not pp.is_last_rank:
            return compat.IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states


class Mamba2PluginForCausalLM(nn.Module, compat.HasInnerState, compat.IsAttentionFree, compat.SupportsPP):
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return state_shapes(vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return compat.state_dtypes(vllm_config.model_config, vllm_config.cache_config)

    @classmethod
    def get_mamba_state_copy_func(cls):  # 0.26's runner: copies a state between blocks (prefix caching)
        return compat.mamba2_state_copy_funcs()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types):  # 0.32's runner: the same, per Mamba type
        return {t: compat.mamba2_state_copy_funcs() for t in mamba_types}

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_hf_config(config)
        if vllm_config.cache_config.enable_prefix_caching:
            patches.install_worker()  # this is the worker process: its runner moves states between blocks
        self.config = config
        self.backbone = Mamba2Backbone(vllm_config=vllm_config, prefix=compat.maybe_prefix(prefix, "backbone"))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if compat.get_pp_group().is_last_rank:
            self.lm_head = compat.ParallelLMHead(
                config.vocab_size, config.hidden_size, prefix=compat.maybe_prefix(prefix, "lm_head")
            )
            if self.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.backbone.embeddings)
        else:
            self.lm_head = compat.PPMissingLayer()
        self.logits_processor = compat.LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.backbone.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)

    get_input_embeddings = embed_input_ids  # the name vLLM 0.26 calls

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.backbone(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states, *args, **kwargs)

    # ---- weights ------------------------------------------------------------------------------------------
    @staticmethod
    def _checkpoint_to_param_name(name: str) -> str:
        if name.startswith("model."):  # some exports prefix the backbone as "model."
            name = "backbone." + name[len("model."):]
        if name == "backbone.embedding.weight":  # mamba-ssm naming
            name = "backbone.embeddings.weight"
        if name.endswith(".mixer.A_log"):
            name = name[: -len("A_log")] + "A"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        full_shapes = checkpoint_shapes(self.config)
        loaded: set[str] = set()
        unexpected: list[str] = []
        bad_shape: list[str] = []
        for ckpt_name, tensor in weights:
            name = self._checkpoint_to_param_name(ckpt_name)
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding matrix is the head
            want = full_shapes.get(_layer_free(name))
            if want is None or (name not in params and not compat.is_pp_missing_parameter(name, self)):
                unexpected.append(ckpt_name)
                continue
            if tuple(tensor.shape) != want:
                bad_shape.append(f"{ckpt_name}: checkpoint {tuple(tensor.shape)} vs model {want}")
                continue
            if name not in params:
                continue  # another pipeline stage's
            param = params[name]
            if ckpt_name.endswith("A_log"):
                tensor = -torch.exp(tensor.float())
            # The parameter's loader takes this rank's part: the mixer's TP loaders, the vocab-parallel layers' own
            # (they pad the vocab dimension), else a plain copy (replicated norms).
            loader = getattr(param, "weight_loader", compat.default_weight_loader)
            with torch.no_grad():
                loader(param, tensor)
            loaded.add(name)
        missing = sorted(n for n in params if n not in loaded
                         and not (self.tie_word_embeddings and n == "lm_head.weight"))
        if unexpected or bad_shape or missing:
            parts = []
            if missing:
                parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
            if unexpected:
                parts.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
            if bad_shape:
                parts.append(f"wrong shape {bad_shape[:8]}")
            raise ValueError(
                f"{ERROR_PREFIX}: the checkpoint does not match the Mamba2 model its config.json describes: "
                + "; ".join(parts)
                + ". Check that config.json (hidden_size, num_heads, head_dim, n_groups, state_size, "
                "conv_kernel, use_bias, use_conv_bias, tie_word_embeddings) belongs to these weights."
            )
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


def _layer_free(name: str) -> str:
    """The parameter name with a decoder layer's index as ``*`` (the key of ``checkpoint_shapes``)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "backbone" and parts[1] == "layers" and parts[2].isdigit():
        parts[2] = "*"
    return ".".join(parts)


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the whole model (as a checkpoint stores it, A_log as A), keyed by parameter name
    with the layer index as ``*``. Optional tensors appear only where config.json says the model has them."""
    H, P, G, N, W, d = (config.num_heads, config.head_dim, config.n_groups, config.state_size,
                        config.conv_kernel, config.hidden_size)
    inner, conv = H * P, H * P + 2 * G * N
    mixer = {"in_proj.weight": (2 * inner + 2 * G * N + H, d), "conv1d.weight": (conv, 1, W),
             "A": (H,), "D": (H,), "dt_bias": (H,), "norm.weight": (inner,), "out_proj.weight": (d, inner)}
    if config.use_bias:
        mixer.update({"in_proj.bias": (2 * inner + 2 * G * N + H,), "out_proj.bias": (d,)})
    if config.use_conv_bias:
        mixer["conv1d.bias"] = (conv,)
    shapes = {f"backbone.layers.*.mixer.{k}": v for k, v in mixer.items()}
    shapes.update({"backbone.layers.*.norm.weight": (d,), "backbone.embeddings.weight": (config.vocab_size, d),
                   "backbone.norm_f.weight": (d,)})
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes
