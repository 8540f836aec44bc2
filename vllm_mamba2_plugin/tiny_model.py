"""Builds small random Mamba2 checkpoints in the stock HF format, deterministically, with a tokenizer.

They stand in for real checkpoints where none can be downloaded (CI, the README's first command): a
``config.json`` with ``architectures: ["Mamba2ForCausalLM"]``, ``model.safetensors`` with HF weight names, and
a byte-level BPE tokenizer trained on the text below. Weights are scaled so that next-token distributions are
peaky and input-dependent (logit std of a few units), so greedy ties cannot hide or fake agreement between
implementations, and the recurrence has a real memory (decays spread over [0.5, 0.99] per step).

    python -m vllm_mamba2_plugin.tiny_model OUT_DIR [--preset default|test] [--n-groups 2] ... [--format mamba_ssm]
"""

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, replace

import torch

CORPUS = """\
State space models read a sequence one token at a time and carry a fixed-size state from step to step.
Mamba made the state transition depend on the input, so the model can choose what to remember and what to
forget. Mamba-2 restricted the transition to a scalar times the identity for each head, which turns the scan
into structured matrix multiplications: inside a chunk the model computes a masked attention-like product,
and between chunks it passes the state along. Serving such a model is different from serving a transformer.
There is no key-value cache that grows with the prompt; each request owns a constant amount of memory, a
convolution window and a state per layer. A prompt can be split into pieces and resumed from the saved
state. A new request must never see an old request's state. The quick brown fox jumps over the lazy dog.
The rain in Spain stays mainly in the plain. To be or not to be, that is the question. One, two, three,
four, five, six, seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
"""

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]


@dataclass
class TinyMamba2Spec:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_heads: int = 8
    head_dim: int = 16
    n_groups: int = 1
    state_size: int = 16
    conv_kernel: int = 4
    chunk_size: int = 8
    vocab_size: int = 512
    use_conv_bias: bool = True
    use_bias: bool = False
    tie_word_embeddings: bool = False
    time_step_limit: tuple = (0.0, float("inf"))
    logit_scale: float = 4.0
    # "tiny": the scales above (step sizes log-uniform in [0.01, 0.3]); "wide": HF's Mamba2 init with larger
    # projections (embeddings N(0, 1), lm_head N(0, 0.5), in_proj N(0, 0.1) + bias N(0, 0.2), out_proj N(0, 0.1)
    # + bias N(0, 0.1), dt_bias N(0, 1)): step sizes softplus(dt + dt_bias) with a median near 0.6 and a tail
    # past 3, A = -1 .. -num_heads, peaky logits.
    init: str = "tiny"
    seed: int = 0
    train_steps: int = 0  # > 0: fit the weights to CORPUS (next-token loss) so that generation reads as text


PRESETS = {
    # The README's embedded default: small enough for a laptop CPU, big enough to look like a model.
    # Trained for a minute on CORPUS, so the demo continues prompts with (memorised) text.
    "default": TinyMamba2Spec(hidden_size=128, num_hidden_layers=2, num_heads=8, head_dim=32, n_groups=2,
                              state_size=32, chunk_size=64, vocab_size=512, seed=1234, train_steps=300),
    "test": TinyMamba2Spec(),
}

# The model grid of the exactness tests (tests/test_grid_models.py, tests/gpu/test_grid_gpu.py, the serving
# harness): "wide" weights, so large step sizes and peaky logits, over the shapes a bug may depend on. Together:
# d_state 16 / 32 / 64 / 128, head_dim 32 / 64 / 128, n_groups 1 / 4 / 8, conv width 2 / 3 / 4, chunk 64 / 256,
# linear biases on / off, time_step_limit none / (0, 1.5) / (0.05, 6); "h64n128" has the released checkpoints'
# head_dim 64 and d_state 128.
_GRID = dict(hidden_size=256, vocab_size=640, init="wide", num_hidden_layers=2)
GRID = {
    "n32g4": TinyMamba2Spec(**{**_GRID, "num_hidden_layers": 4}, num_heads=16, head_dim=32, n_groups=4,
                            state_size=32, conv_kernel=4, chunk_size=64, use_bias=True,
                            time_step_limit=(0.0, 1.5), seed=42),
    "h64n128": TinyMamba2Spec(**_GRID, num_heads=8, head_dim=64, n_groups=1, state_size=128, conv_kernel=4,
                              chunk_size=256, seed=43),
    "n16g8": TinyMamba2Spec(**{**_GRID, "num_hidden_layers": 3}, num_heads=16, head_dim=32, n_groups=8,
                            state_size=16, conv_kernel=3, chunk_size=64, use_bias=True,
                            time_step_limit=(0.05, 6.0), seed=44),
    "h128n64": TinyMamba2Spec(**_GRID, num_heads=4, head_dim=128, n_groups=1, state_size=64, conv_kernel=2,
                              chunk_size=64, use_conv_bias=False, seed=45),
    "n128g4": TinyMamba2Spec(**_GRID, num_heads=8, head_dim=64, n_groups=4, state_size=128, conv_kernel=3,
                             chunk_size=64, use_bias=True, time_step_limit=(0.0, 1.5), seed=46),
    "n64g8w2": TinyMamba2Spec(**{**_GRID, "num_hidden_layers": 3}, num_heads=16, head_dim=32, n_groups=8,
                              state_size=64, conv_kernel=2, chunk_size=256, use_bias=True,
                              tie_word_embeddings=True, seed=47),
}
PRESETS.update({f"grid-{name}": spec for name, spec in GRID.items()})


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def random_weights(spec: TinyMamba2Spec) -> dict[str, torch.Tensor]:
    if spec.init == "wide":
        return wide_weights(spec)
    if spec.init != "tiny":
        raise ValueError(f"unknown init {spec.init!r}: 'tiny' or 'wide'")
    g = torch.Generator().manual_seed(spec.seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    def uniform(*shape, lo, hi):
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    d, H = spec.hidden_size, spec.num_heads
    d_inner = H * spec.head_dim
    conv_dim = d_inner + 2 * spec.n_groups * spec.state_size
    # Tied embeddings score the current token's own embedding highly (E[t]·E[t] ~ d), which makes a random
    # model repeat itself; small embeddings let the mixers' output dominate the residual stream instead.
    embed_std = 0.2 if spec.tie_word_embeddings else 1.0
    w = {"backbone.embeddings.weight": normal(spec.vocab_size, d, std=embed_std)}
    for i in range(spec.num_hidden_layers):
        p = f"backbone.layers.{i}."
        w[p + "norm.weight"] = 1.0 + normal(d, std=0.1)
        w[p + "mixer.in_proj.weight"] = normal(2 * d_inner + 2 * spec.n_groups * spec.state_size + H, d,
                                               std=1.0 / math.sqrt(d))
        if spec.use_bias:
            w[p + "mixer.in_proj.bias"] = normal(2 * d_inner + 2 * spec.n_groups * spec.state_size + H, std=0.1)
        w[p + "mixer.conv1d.weight"] = normal(conv_dim, 1, spec.conv_kernel, std=0.5)
        if spec.use_conv_bias:
            w[p + "mixer.conv1d.bias"] = normal(conv_dim, std=0.1)
        # Mamba-2's dt init: dt log-uniform, stored as softplus^-1(dt) in dt_bias.
        dt = torch.exp(uniform(H, lo=math.log(0.01), hi=math.log(0.3)))
        w[p + "mixer.dt_bias"] = dt + torch.log(-torch.expm1(-dt))
        w[p + "mixer.A_log"] = torch.log(uniform(H, lo=1.0, hi=8.0))
        w[p + "mixer.D"] = uniform(H, lo=0.5, hi=1.5)
        w[p + "mixer.norm.weight"] = 1.0 + normal(d_inner, std=0.1)
        w[p + "mixer.out_proj.weight"] = normal(d, d_inner, std=1.0 / math.sqrt(d_inner))
        if spec.use_bias:
            w[p + "mixer.out_proj.bias"] = normal(d, std=0.1)
    w["backbone.norm_f.weight"] = torch.ones(d)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = normal(spec.vocab_size, d, std=spec.logit_scale / math.sqrt(d))
    else:  # tied: scale the shared matrix's effect through norm_f instead
        w["backbone.norm_f.weight"] = torch.full((d,), spec.logit_scale / (embed_std * math.sqrt(d)))
    return {k: v.contiguous() for k, v in w.items()}


def wide_weights(spec: TinyMamba2Spec) -> dict[str, torch.Tensor]:
    """HF's Mamba2 init (A_log = log(1 .. H), D = 1, unit norms, conv weights U(+-1/sqrt(W))) with the larger
    projection scales of the "wide" init (TinyMamba2Spec.init)."""
    g = torch.Generator().manual_seed(spec.seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    d, H, W = spec.hidden_size, spec.num_heads, spec.conv_kernel
    d_inner = H * spec.head_dim
    conv_dim = d_inner + 2 * spec.n_groups * spec.state_size
    width = d_inner + conv_dim + H
    w = {"backbone.embeddings.weight": normal(spec.vocab_size, d, std=1.0)}
    for i in range(spec.num_hidden_layers):
        p = f"backbone.layers.{i}."
        w[p + "norm.weight"] = torch.ones(d)
        w[p + "mixer.in_proj.weight"] = normal(width, d, std=0.1)
        w[p + "mixer.conv1d.weight"] = (2 * torch.rand(conv_dim, 1, W, generator=g) - 1) / math.sqrt(W)
        if spec.use_conv_bias:
            w[p + "mixer.conv1d.bias"] = normal(conv_dim, std=0.1)
        w[p + "mixer.dt_bias"] = normal(H, std=1.0)
        # In float64, then rounded: float32 log is vectorised differently per CPU (AVX2 / AVX-512) and its last bit
        # differs between machines, and with it the checkpoint (and the oracle's cached answers keyed by it).
        w[p + "mixer.A_log"] = torch.log(torch.arange(1, H + 1, dtype=torch.float64)).float()
        w[p + "mixer.D"] = torch.ones(H)
        w[p + "mixer.norm.weight"] = torch.ones(d_inner)
        w[p + "mixer.out_proj.weight"] = normal(d, d_inner, std=0.1)
        if spec.use_bias:
            w[p + "mixer.in_proj.bias"] = normal(width, std=0.2)
            w[p + "mixer.out_proj.bias"] = normal(d, std=0.1)
    w["backbone.norm_f.weight"] = torch.ones(d)
    if spec.tie_word_embeddings:  # the shared matrix is N(0, 1): scale the head's logits through norm_f
        w["backbone.norm_f.weight"] = torch.full((d,), 0.5)
    else:
        w["lm_head.weight"] = normal(spec.vocab_size, d, std=0.5)
    return {k: v.contiguous() for k, v in w.items()}


def _forward_logits(w: dict, spec: TinyMamba2Spec, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Training forward over packed sequences (ids: (T,), bounds cu), with the plugin's reference kernels
    (plain differentiable torch). Same math as the served model; used only to fit the demo weights."""
    from .kernels import reference as ref
    from .kernels.interface import PrefillBatch

    def rms(h, weight):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    H, P, G, N = spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size
    d_inner = H * P
    h = w["backbone.embeddings.weight"][ids]
    residual = torch.zeros_like(h)
    batch = PrefillBatch.of(cu, chunk_size=spec.chunk_size)
    for i in range(spec.num_hidden_layers):
        p = f"backbone.layers.{i}."
        residual = residual + h
        proj = rms(residual, w[p + "norm.weight"]) @ w[p + "mixer.in_proj.weight"].T
        z, xBC, dt = torch.split(proj, [d_inner, d_inner + 2 * G * N, H], dim=-1)
        xBC = ref.causal_conv1d(xBC, w[p + "mixer.conv1d.weight"][:, 0], w.get(p + "mixer.conv1d.bias"), batch).out
        x, B, C = torch.split(xBC, [d_inner, G * N, G * N], dim=-1)
        dt = ref.process_dt(dt, w[p + "mixer.dt_bias"], spec.time_step_limit)
        y = ref.ssd_chunk_scan(x.reshape(-1, H, P), dt, -torch.exp(w[p + "mixer.A_log"]),
                               B.reshape(-1, G, N), C.reshape(-1, G, N), batch, D=w[p + "mixer.D"]).y
        y = ref.gated_rms_norm(y.reshape(-1, d_inner), z, w[p + "mixer.norm.weight"], 1e-5, d_inner // G)
        h = y @ w[p + "mixer.out_proj.weight"].T
    head = w.get("lm_head.weight", w["backbone.embeddings.weight"])
    return rms(residual + h, w["backbone.norm_f.weight"]) @ head.T


def train_on_corpus(w: dict, spec: TinyMamba2Spec, tokenizer) -> dict:
    """Fit the weights to CORPUS with a next-token loss (seeded, single-threaded: the same result on the
    same CPU and torch build). Returns detached weights."""
    ids = torch.tensor(tokenizer.encode(CORPUS).ids)
    g = torch.Generator().manual_seed(spec.seed + 1)
    params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    opt = torch.optim.AdamW(params.values(), lr=3e-3, weight_decay=0.0)
    window, batch = min(64, len(ids) - 1), 16
    cu = torch.arange(batch + 1) * window
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(spec.train_steps):
            starts = torch.randint(0, len(ids) - window, (batch,), generator=g)
            seqs = torch.stack([ids[s: s + window + 1] for s in starts.tolist()])
            logits = _forward_logits(params, spec, seqs[:, :-1].reshape(-1), cu)
            loss = torch.nn.functional.cross_entropy(logits, seqs[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    print(f"trained {spec.train_steps} steps on the built-in corpus: final loss {loss.item():.3f}")
    return {k: v.detach().contiguous() for k, v in params.items()}


def hf_config_dict(spec: TinyMamba2Spec, tokenizer) -> dict:
    lo, hi = spec.time_step_limit
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_heads": spec.num_heads,
        "head_dim": spec.head_dim,
        "expand": spec.num_heads * spec.head_dim // spec.hidden_size,
        "n_groups": spec.n_groups,
        "state_size": spec.state_size,
        "conv_kernel": spec.conv_kernel,
        "chunk_size": spec.chunk_size,
        "vocab_size": spec.vocab_size,
        "use_bias": spec.use_bias,
        "use_conv_bias": spec.use_conv_bias,
        "hidden_act": "silu",
        "layer_norm_epsilon": 1e-5,
        "rms_norm": True,
        "residual_in_fp32": True,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "time_step_limit": [lo, hi],
        "time_step_rank": max(1, math.ceil(spec.hidden_size / 16)),
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": tokenizer.token_to_id("<|eos|>"),
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
        "torch_dtype": "float32",
    }


def build(out_dir: str, spec: TinyMamba2Spec | None = None, **overrides) -> str:
    """Write a tiny HF Mamba2 checkpoint + tokenizer to out_dir (idempotent for the same spec)."""
    from safetensors.torch import save_file

    spec = replace(spec or TinyMamba2Spec(), **overrides)
    if (spec.num_heads * spec.head_dim) % spec.hidden_size:
        raise ValueError("num_heads * head_dim must be a multiple of hidden_size (HF's expand)")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError("tokenizer vocabulary larger than the model's")
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
                   "eos_token": "<|eos|>", "pad_token": "<|pad|>", "model_max_length": 4096,
                   "clean_up_tokenization_spaces": False}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(spec, tokenizer), f, indent=2)
    weights = random_weights(spec)
    if spec.train_steps > 0:
        weights = train_on_corpus(weights, spec, tokenizer)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tiny_spec.json"), "w") as f:
        json.dump(asdict(spec), f, indent=2)
    return out_dir


def export_mamba_ssm(hf_dir: str, out_dir: str, weights: str = "bin", vocab_size: int | None = None,
                     pad_vocab_size_multiple: int = 8) -> str:
    """Write the checkpoint in hf_dir in mamba_ssm's own format (what ``MambaLMHeadModel.save_pretrained`` writes;
    the format of state-spaces/mamba2-*): its config.json (the Mamba2 arguments that differ from mamba_ssm's
    defaults in ``ssm_cfg``) and ``pytorch_model.bin`` (weights="bin"; a tied ``lm_head.weight`` included, as
    mamba_ssm's state dict has it) or ``model.safetensors``, with mamba_ssm's names. ``vocab_size``: the config's
    unpadded vocabulary (default: the embedding's rows), which ``pad_vocab_size_multiple`` must round up to the
    embedding's rows. No tokenizer, like the released checkpoints."""
    from safetensors.torch import load_file, save_file

    from .mamba_ssm_format import MAMBA2_DEFAULTS, padded_vocab

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    w = load_file(os.path.join(hf_dir, "model.safetensors"))
    rows = w["backbone.embeddings.weight"].shape[0]
    vocab_size = vocab_size or rows
    if padded_vocab(vocab_size, pad_vocab_size_multiple) != rows:
        raise ValueError(f"vocab_size {vocab_size} padded to a multiple of {pad_vocab_size_multiple} is not the "
                         f"embedding's {rows} rows")
    ssm = dict(d_state=hf["state_size"], d_conv=hf["conv_kernel"], expand=hf["expand"], headdim=hf["head_dim"],
               ngroups=hf["n_groups"], chunk_size=hf["chunk_size"], bias=hf["use_bias"],
               conv_bias=hf["use_conv_bias"], dt_limit=tuple(hf["time_step_limit"]))
    config = dict(d_model=hf["hidden_size"], d_intermediate=0, n_layer=hf["num_hidden_layers"], vocab_size=vocab_size,
                  ssm_cfg={"layer": "Mamba2", **{k: v for k, v in ssm.items() if v != MAMBA2_DEFAULTS[k]}},
                  attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                  pad_vocab_size_multiple=pad_vocab_size_multiple, tie_embeddings=hf["tie_word_embeddings"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    w["backbone.embedding.weight"] = w.pop("backbone.embeddings.weight")
    if weights == "bin":
        if hf["tie_word_embeddings"]:
            w["lm_head.weight"] = w["backbone.embedding.weight"]
        torch.save(w, os.path.join(out_dir, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def is_built(out_dir: str, spec: TinyMamba2Spec) -> bool:
    """True if out_dir holds a checkpoint this module built from exactly this spec."""
    try:
        with open(os.path.join(out_dir, "tiny_spec.json")) as f:
            built = json.load(f)
    except (OSError, ValueError):
        return False
    want = json.loads(json.dumps(asdict(spec)))  # tuples -> lists, as stored
    return built == want and os.path.exists(os.path.join(out_dir, "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--format", choices=["hf", "mamba_ssm"], default="hf",
                    help="mamba_ssm: mamba_ssm's own format (config.json with ssm_cfg, pytorch_model.bin), as the "
                         "state-spaces/mamba2-* checkpoints; the HF copy goes to OUT_DIR/hf")
    for field, default in asdict(TinyMamba2Spec()).items():
        if isinstance(default, bool):
            ap.add_argument(f"--{field.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"))
        elif isinstance(default, (int, float, str)):
            ap.add_argument(f"--{field.replace('_', '-')}", type=type(default))
    args = ap.parse_args()
    spec = PRESETS[args.preset]
    overrides = {k: v for k, v in vars(args).items() if k not in ("out_dir", "preset", "format") and v is not None}
    spec = TinyMamba2Spec(**{**asdict(spec), **overrides})
    if args.format == "hf":
        print(build(args.out_dir, spec))
    else:
        print(export_mamba_ssm(build(os.path.join(args.out_dir, "hf"), spec), args.out_dir))


if __name__ == "__main__":
    main()
