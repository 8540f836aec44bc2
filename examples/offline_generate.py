"""Offline generation with vLLM + the Mamba2 plugin.

    python examples/offline_generate.py                      # the embedded default model (built on first use)
    python examples/offline_generate.py --model state-spaces/mamba2-130m-hf-style-dir --max-tokens 128

The plugin needs no code here: installed next to vLLM, it registers itself through the
``vllm.general_plugins`` entry point and takes over ``Mamba2ForCausalLM``.
"""

import argparse
import os
import time

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "tiny-mamba2")
PROMPTS = [
    "State space models read a sequence",
    "The quick brown fox",
    "Serving such a model is different",
    "One, two, three,",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF Mamba2 checkpoint dir (default: the embedded tiny model)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16, help="requests in the batch (prompts cycle)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    model = args.model
    if model is None:
        from vllm_mamba2_plugin import tiny_model

        model = os.path.normpath(DEFAULT_MODEL_DIR)
        if not tiny_model.is_built(model, tiny_model.PRESETS["default"]):
            tiny_model.build(model, tiny_model.PRESETS["default"])
            print(f"built the embedded default model in {model}")

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, max_model_len=2048, max_num_seqs=min(args.num_prompts, 64))
    which = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    for out in outputs[: len(PROMPTS)]:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text!r}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\nmodel class: {which}")
    print(f"{len(outputs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f} s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s")


if __name__ == "__main__":
    main()
