"""The local stack: real servers on 127.0.0.1 that the local launcher mode's steps run against.

    python -m stack up       start (or reuse) SeaweedFS (S3), MLflow, Triton, the OpenAI front, the router
                             (nginx), the Pushgateway and Prometheus
    python -m stack up --airflow   ... and the Airflow UI: api-server, scheduler, dag-processor, triggerer
    python -m stack down     stop them by PID
    python -m stack status   one line per server
    python -m stack env      ``export`` lines for a shell: endpoints and generated keys
    python -m stack predict "PROMPT"   a completion from the serving model, through the router
    python -m stack retrain-conf   `make retrain`'s run configuration (JSON) from BASE, EVAL_SET, END_DATE, LOOKBACK
    python -m stack drift-data     `make drift-loop`'s: land new raw days partly in the drifted domain,
                                   print the retrain's run configuration (JSON; stack/drift_loop.py)
    python -m stack traffic normal|drifted [--count N]   demo traffic through the router, then the
                                       capture flushed (stack/traffic.py; what the drift check reads)
    python -m stack compose-init   docker-compose.yaml's set-up (buckets, router config, pools), in its container
    python -m stack mlflow-users   the pipeline's MLflow login, created by the admin (compose's mlflow-users)
    python -m stack reconcile-serving   load what the router's route serves into a Triton that restarted
                                        empty (TRITON_URL, TRITON_REPOSITORY, ROUTER_DIR; compose's serving-reconcile)
    python -m stack metrics-auth DIR   Prometheus' and the Pushgateway's logins from PROMETHEUS_PASSWORD and
                                       PUSHGATEWAY_PASSWORD, into DIR/prometheus and DIR/pushgateway (compose's)
    python -m stack s3-identities DIR  SeaweedFS's identities (DIR/s3.json): the pipeline's keys (AWS_*) and the
                                       OpenAI front's capture-only keys (CAPTURE_AWS_*) (compose's)

Runs in the runtime environment (it holds ``weed`` and ``mlflow``). State lives in
``.stack/`` (or ``$STACK_DIR``): data, logs, PIDs, the generated S3 keys and ``stack.env``.
Ports come from the ``stack`` section of params.yaml; ``STACK_PORT_<NAME>`` overrides one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from stack.credentials import client_env, write_env_file
from stack.mlflow_server import ensure_mlflow_pipeline_user
from stack.prometheus import write_metrics_auth
from stack.seaweedfs import s3_identities
from stack.servers import down, init_compose_stack, status, up
from stack.serving import publish_saved_route, reconcile_serving
from stack.state import ports, write_private
from stack.supervise import StackError

# docker-compose.yaml's s3-identities: the variables of each identity's keys (access, secret)
S3_IDENTITY_VARIABLES = {"pipeline": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
                         "capture": ("CAPTURE_AWS_ACCESS_KEY_ID", "CAPTURE_AWS_SECRET_ACCESS_KEY")}


def predict(prompt: str, max_tokens: int, model: str | None = None) -> int:
    """A completion through the router's OpenAI-compatible API (the traffic split a client
    sees), streamed token by token as the engine produces them, with the version that answered;
    one line of error when nothing serves yet."""
    import openai

    from tasks.config import load

    url = f"{client_env()['ROUTER_URL']}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    try:
        with client.completions.with_streaming_response.create(
                model=model or load().pipeline.model_name, prompt=prompt, max_tokens=max_tokens, stream=True) as resp:
            print(f"[version {resp.headers.get('X-Model-Version', '?')}] {prompt}", end="", flush=True)
            for chunk in resp.parse():
                print(chunk.choices[0].text if chunk.choices else "", end="", flush=True)
    except openai.APIStatusError as exc:
        print(f"error: {url}/completions: {exc.status_code} {exc.message} (is a model serving? run `make pipeline` "
              "first, or `make retrain LINE=<name>` for a model line)", file=sys.stderr)
        return 1
    except openai.APIConnectionError as exc:
        print(f"error: {url}/completions: {exc} (is the stack up? run `make pipeline` first)", file=sys.stderr)
        return 1
    print()
    return 0


def retrain_conf() -> int:
    """`make retrain`'s run configuration from its variables (BASE, EVAL_SET, END_DATE, LOOKBACK in
    the environment), as JSON: local paths made absolute (the steps run elsewhere), the window
    ending tomorrow unless END_DATE says otherwise (today's imports are in it)."""
    import datetime as dt

    env = os.environ

    def located(value: str) -> str:
        return value if "://" in value else str(Path(value).resolve())

    conf: dict[str, object] = {"end_date": env.get("END_DATE") or str(dt.datetime.now(dt.UTC).date() + dt.timedelta(days=1))}
    if env.get("BASE"):
        conf["train_base"] = located(env["BASE"])
    if env.get("EVAL_SET"):
        conf["eval_set_uri"] = located(env["EVAL_SET"])
    if env.get("LOOKBACK"):
        conf["lookback_days"] = int(env["LOOKBACK"])
    print(json.dumps(conf))
    return 0


def write_compose_metrics_auth(folder: str) -> int:
    """The logins of Prometheus and the Pushgateway, into ``folder``/prometheus and
    ``folder``/pushgateway (a volume each, mounted by that server only), readable by the user
    those images run as; one line when the folder or a password is missing."""
    passwords = {name: os.environ.get(name, "") for name in ("PROMETHEUS_PASSWORD", "PUSHGATEWAY_PASSWORD")}
    missing = ([] if folder else ["a folder"]) + [name for name, value in passwords.items() if not value]
    if missing:
        print(f"error: metrics-auth needs {' and '.join(missing)} (in the environment)", file=sys.stderr)
        return 2
    write_metrics_auth(Path(folder) / "prometheus", Path(folder) / "pushgateway", passwords["PROMETHEUS_PASSWORD"],
                       passwords["PUSHGATEWAY_PASSWORD"], mode=0o644)
    print(f"metrics logins written to {folder}/prometheus and {folder}/pushgateway")
    return 0


def write_compose_s3_identities(folder: str) -> int:
    """SeaweedFS's ``-s3.config`` into ``folder``/s3.json (a volume only SeaweedFS and this
    one-shot mount), readable by the user its image runs as: the pipeline's identity and the
    OpenAI front's, which may only write the capture (serve.capture.uri); one line when the folder
    or a key is missing, or when both identities share an access key."""
    from tasks.config import load

    variables = [name for pair in S3_IDENTITY_VARIABLES.values() for name in pair]
    missing = ([] if folder else ["a folder"]) + [name for name in variables if not os.environ.get(name)]
    if missing:
        print(f"error: s3-identities needs {', '.join(missing)} (in the environment)", file=sys.stderr)
        return 2
    keys = {identity: {"access_key": os.environ[access], "secret_key": os.environ[secret]}
            for identity, (access, secret) in S3_IDENTITY_VARIABLES.items()}
    try:
        config = s3_identities(keys["pipeline"], keys["capture"], load().serve.capture.uri)
    except ValueError as exc:
        print(f"error: s3-identities: {exc} (CAPTURE_AWS_ACCESS_KEY_ID)", file=sys.stderr)
        return 2
    write_private(Path(folder) / "s3.json", json.dumps(config), mode=0o644)
    print(f"S3 identities written to {folder}/s3.json")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env", "predict", "traffic", "retrain-conf", "drift-data",
                                            "compose-init",
                                            "reconcile-serving", "mlflow-users", "metrics-auth", "s3-identities"])
    parser.add_argument("prompt", nargs="?", default="",
                        help="with `predict`: the text to continue; with `traffic`: normal or drifted; with "
                        "`metrics-auth` and `s3-identities`: the folder to write")
    parser.add_argument("--airflow", action="store_true", help="with `up`: also start Airflow (needs its venv)")
    parser.add_argument("--max-tokens", type=int, default=24, help="with `predict`: tokens to generate")
    parser.add_argument("--model", help="with `predict`: the served model to ask (default: the line's, PIPELINE_LINE)")
    parser.add_argument("--count", type=int, default=200, help="with `traffic`: prompts to send")
    args = parser.parse_args()
    if args.command == "predict":
        if not args.prompt:
            parser.error("predict needs a PROMPT")
        return predict(args.prompt, args.max_tokens, args.model)
    if args.command == "traffic":
        from stack.traffic import KINDS, send

        if args.prompt not in KINDS:
            parser.error(f"traffic needs a kind: {' or '.join(KINDS)}")
        sent = send(client_env(), args.prompt, args.count)
        print(f"sent {sent['sent']} {args.prompt} prompts from {sent['clients']} client addresses: {sent['ok']} "
              f"answered, {sent['refused']} refused "
              f"(4xx: too long for the context, ...), {sent['failed']} failed; e.g. {sent['example']!r}; "
              f"capture: {sent['capture']}")
        return 0 if sent["ok"] and not sent["failed"] else 1
    if args.command == "retrain-conf":
        return retrain_conf()
    if args.command == "drift-data":
        from stack import drift_loop

        return drift_loop.main()
    if args.command == "compose-init":
        init_compose_stack()
        return 0
    if args.command == "mlflow-users":  # docker-compose.yaml's: the container's environment
        ensure_mlflow_pipeline_user(os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_ADMIN_PASSWORD"],
                                    os.environ["MLFLOW_TRACKING_PASSWORD"])
        return 0
    if args.command == "metrics-auth":  # docker-compose.yaml's: the container's environment
        return write_compose_metrics_auth(args.prompt)
    if args.command == "s3-identities":  # docker-compose.yaml's: the container's environment
        return write_compose_s3_identities(args.prompt)
    if args.command == "reconcile-serving":
        env = os.environ if "TRITON_URL" in os.environ else client_env()
        try:
            loaded = reconcile_serving(env)
            print(f"serving: loaded the routes' versions {loaded}" if loaded else
                  "serving: the routes' versions are ready")
        except StackError as exc:  # as `up` does: the rest of the stack still comes up, the alert pages
            print(f"warning: {exc}; requests for them fail until a deploy", file=sys.stderr)
        publish_saved_route(env)
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
        write_env_file()  # the steps' (stack.env); people get their logins too
        for key, value in client_env().items():
            print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
