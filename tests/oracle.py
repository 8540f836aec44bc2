"""The independent oracle: a plain step-by-step Mamba2 recurrence over an HF checkpoint, in float64.

Written from the Mamba-2 paper and the HF weight layout, sharing no code with the plugin: one token at a
time, per-token conv-window shift, h = exp(dt·A)·h + dt·x⊗B, y = h·C + D·x, per-group gated RMSNorm
(mamba-ssm / vLLM semantics; docs/architecture.md §6 explains why HF's whole-width norm is not used for n_groups > 1).
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class RecurrentMamba2:
    def __init__(self, model_dir: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        raw = load_file(os.path.join(model_dir, "model.safetensors"))
        self.w = {k: v.to(torch.float64) for k, v in raw.items()}
        c = self.cfg
        self.H, self.P, self.G, self.N = c["num_heads"], c["head_dim"], c["n_groups"], c["state_size"]
        self.W = c["conv_kernel"]
        self.d_inner = self.H * self.P
        self.conv_dim = self.d_inner + 2 * self.G * self.N
        self.eps = c["layer_norm_epsilon"]
        lim = c.get("time_step_limit") or [0.0, math.inf]
        self.dt_min, self.dt_max = float(lim[0]), float(lim[1])
        self.lm_head = self.w.get("lm_head.weight", self.w["backbone.embeddings.weight"])
        if c.get("tie_word_embeddings"):
            self.lm_head = self.w["backbone.embeddings.weight"]

    def new_state(self):
        L = self.cfg["num_hidden_layers"]
        return [
            (torch.zeros(self.W - 1, self.conv_dim, dtype=torch.float64),
             torch.zeros(self.H, self.P, self.N, dtype=torch.float64))
            for _ in range(L)
        ]

    @staticmethod
    def _rms(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def step(self, token: int, state) -> torch.Tensor:
        """Advance every layer by one token (state updated in place); return the logits (vocab,)."""
        w, H, P, G, N = self.w, self.H, self.P, self.G, self.N
        u = w["backbone.embeddings.weight"][token]
        residual = None
        for i, (conv_s, ssm_s) in enumerate(state):
            p = f"backbone.layers.{i}."
            residual = u if residual is None else residual + u
            h_in = self._rms(residual, w[p + "norm.weight"], self.eps)
            proj = w[p + "mixer.in_proj.weight"] @ h_in
            if p + "mixer.in_proj.bias" in w:
                proj = proj + w[p + "mixer.in_proj.bias"]
            z, xBC, dt = proj[: self.d_inner], proj[self.d_inner: self.d_inner + self.conv_dim], proj[-H:]
            # conv: window = last W-1 inputs + this one
            window = torch.cat([conv_s, xBC[None]], 0)  # (W, conv_dim), oldest first
            conv_s.copy_(window[1:])
            kern = w[p + "mixer.conv1d.weight"][:, 0, :]  # (conv_dim, W)
            xc = (window.T * kern).sum(-1)
            if p + "mixer.conv1d.bias" in w:
                xc = xc + w[p + "mixer.conv1d.bias"]
            xc = xc * torch.sigmoid(xc)
            x = xc[: self.d_inner].view(H, P)
            B = xc[self.d_inner: self.d_inner + G * N].view(G, N)
            C = xc[self.d_inner + G * N:].view(G, N)
            dt = F.softplus(dt + w[p + "mixer.dt_bias"]).clamp(self.dt_min, self.dt_max)
            A = -torch.exp(w[p + "mixer.A_log"])
            Bh, Ch = B.repeat_interleave(H // G, 0), C.repeat_interleave(H // G, 0)  # head h reads group h // (H/G)
            ssm_s.mul_(torch.exp(dt * A)[:, None, None]).add_(dt[:, None, None] * x[:, :, None] * Bh[:, None, :])
            y = (ssm_s @ Ch[:, :, None])[..., 0] + w[p + "mixer.D"][:, None] * x
            gated = y.reshape(-1) * (z * torch.sigmoid(z))
            gs = self.d_inner // G
            normed = torch.cat([self._rms(gated[k * gs:(k + 1) * gs], 1.0, self.eps) for k in range(G)])
            u = w[p + "mixer.out_proj.weight"] @ (normed * w[p + "mixer.norm.weight"])
            if p + "mixer.out_proj.bias" in w:
                u = u + w[p + "mixer.out_proj.bias"]
        final = self._rms(residual + u, w["backbone.norm_f.weight"], self.eps)
        return self.lm_head @ final

    def generate(self, prompt: list[int], max_tokens: int):
        """Greedy generation. Returns (generated tokens, prompt logprobs (list, None for the first),
        per generated step the full logprob vector)."""
        state = self.new_state()
        prompt_logprobs = [None]
        logits = None
        for i, t in enumerate(prompt):
            if logits is not None:
                prompt_logprobs.append(torch.log_softmax(logits, -1)[t].item())
            logits = self.step(t, state)
        out, step_logprobs = [], []
        for _ in range(max_tokens):
            lp = torch.log_softmax(logits, -1)
            nxt = int(torch.argmax(lp))
            out.append(nxt)
            step_logprobs.append(lp)
            logits = self.step(nxt, state)
        return out, prompt_logprobs, step_logprobs

    def score(self, prompt: list[int], continuation: list[int]) -> list[float]:
        """Teacher-forced logprob of each continuation token after prompt + the continuation before it."""
        state = self.new_state()
        logits = None
        for t in prompt:
            logits = self.step(t, state)
        out = []
        for t in continuation:
            out.append(torch.log_softmax(logits, -1)[t].item())
            logits = self.step(t, state)
        return out


_CACHE: dict = {}


def oracle_generate(oracle: RecurrentMamba2, prompt: list[int], max_tokens: int):
    """Memoised RecurrentMamba2.generate (the recurrence is slow; many tests ask the same question)."""
    key = (id(oracle), tuple(prompt), max_tokens)
    if key not in _CACHE:
        _CACHE[key] = oracle.generate(prompt, max_tokens)
    return _CACHE[key]
