"""The local stack: real servers on 127.0.0.1 that the embedded default runs against.

    python -m stack up       start (or reuse) SeaweedFS (S3) and the MLflow server
    python -m stack up --airflow   ... and the Airflow UI: api-server, scheduler, dag-processor, triggerer
    python -m stack down     stop them by PID
    python -m stack status   one line per server
    python -m stack env      ``export`` lines for a shell: endpoints and generated keys

Runs in the runtime environment (it holds ``weed`` and ``mlflow``). State lives in
``.stack/`` (or ``$STACK_DIR``): data, logs, PIDs, the generated S3 keys and ``stack.env``.
Ports come from the ``stack`` section of params.yaml; ``STACK_PORT_<NAME>`` overrides one.
"""

from __future__ import annotations

import argparse
import sys

from stack.servers import down, ports, status, up, write_env_file


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--airflow", action="store_true", help="with `up`: also start Airflow (needs its venv)")
    args = parser.parse_args()
    if args.command == "up":
        env = up(with_airflow=args.airflow)
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
