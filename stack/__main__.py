"""The local stack: real servers on 127.0.0.1 that the embedded default runs against.

    python -m stack up       start (or reuse) SeaweedFS (S3) and the MLflow server
    python -m stack up --airflow   ... and the Airflow UI: api-server, scheduler, dag-processor, triggerer
    python -m stack down     stop them by PID
    python -m stack status   one line per server
    python -m stack env      ``export`` lines for a shell: endpoints and generated keys
    python -m stack predict "PROMPT"   a completion from the serving model, through the router
    python -m stack compose-init   docker-compose.yaml's set-up (buckets, router config, pools), in its container

Runs in the runtime environment (it holds ``weed`` and ``mlflow``). State lives in
``.stack/`` (or ``$STACK_DIR``): data, logs, PIDs, the generated S3 keys and ``stack.env``.
Ports come from the ``stack`` section of params.yaml; ``STACK_PORT_<NAME>`` overrides one.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from stack.servers import StackError, client_env, down, init_compose_stack, ports, status, up, write_env_file


def predict(prompt: str, max_tokens: int) -> int:
    """Text in, text out through the router (the traffic split a client sees), with the version
    that answered; one line of error when nothing serves yet."""
    from tasks.lib.params import load_params

    url = f"{client_env()['ROUTER_URL']}/v2/models/{load_params()['serve']['generate_model']}/infer"
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [prompt]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [max_tokens]}]}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer, version = json.loads(resp.read()), resp.headers.get("X-Model-Version", "?")
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: {url}: {exc} (is a model serving? run `make pipeline` first)", file=sys.stderr)
        return 1
    print(f"[version {version}] {prompt}{answer['outputs'][0]['data'][0]}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env", "predict", "compose-init"])
    parser.add_argument("prompt", nargs="?", default="", help="with `predict`: the text to continue")
    parser.add_argument("--airflow", action="store_true", help="with `up`: also start Airflow (needs its venv)")
    parser.add_argument("--max-tokens", type=int, default=24, help="with `predict`: tokens to generate")
    args = parser.parse_args()
    if args.command == "predict":
        if not args.prompt:
            parser.error("predict needs a PROMPT")
        return predict(args.prompt, args.max_tokens)
    if args.command == "compose-init":
        init_compose_stack()
        return 0
    if args.command == "up":
        try:
            env = up(with_airflow=args.airflow)
        except StackError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"stack up: S3 {env['AWS_ENDPOINT_URL']}, MLflow {env['MLFLOW_TRACKING_URI']}")
        if args.airflow:
            print(f"Airflow UI: http://127.0.0.1:{ports()['airflow']} (users in airflow.cfg)")
    elif args.command == "down":
        down()
    elif args.command == "status":
        healthy = status()
        for name, ok in healthy.items():
            print(f"{name}: {'healthy' if ok else 'down'}")
        return 0 if all(healthy.values()) else 1
    else:
        for key, value in write_env_file().items():
            print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
