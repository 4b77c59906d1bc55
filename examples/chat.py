"""Chat with the served model through the router, as any OpenAI client does (the openai SDK):
the model's own chat template renders the messages (docs/serving.md).

    .venvs/runtime/bin/python -m examples.chat "What does this function return?" [--system "..."] [--model NAME]

The router's address: OPENAI_BASE_URL, else the local stack's (``.stack/stack.env``, or
``$STACK_DIR/stack.env``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import openai


def base_url() -> str:
    if os.environ.get("OPENAI_BASE_URL"):
        return os.environ["OPENAI_BASE_URL"]
    env_file = Path(os.environ.get("STACK_DIR", ".stack")) / "stack.env"
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    return f"{values['ROUTER_URL']}/v1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("message")
    p.add_argument("--system", default="You answer in one line.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", help="the served model to ask (a line's registered name); default: the first listed")
    args = p.parse_args()
    client = openai.OpenAI(base_url=base_url(), api_key="unused", max_retries=0, timeout=60)
    model = args.model or client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, max_tokens=args.max_tokens, temperature=0,
        messages=[{"role": "system", "content": args.system}, {"role": "user", "content": args.message}])
    usage = answer.usage
    print(f"[{model}, {usage.prompt_tokens if usage else '?'} prompt tokens] {answer.choices[0].message.content}")


if __name__ == "__main__":
    main()
