"""MLflow's tracking server: its basic-auth app's settings, the pipeline's user, its command and
environment."""

from __future__ import annotations

import configparser
import contextlib
import io
import os

from stack.credentials import MLFLOW_ADMIN, MLFLOW_PIPELINE_USER, client_env, secret
from stack.state import ports, state_dir
from stack.supervise import StackError, bin_path
from tasks.config import load


def mlflow_auth_config(database_uri: str) -> str:
    """MLflow's basic-auth app's settings (no secret in them: the admin's password comes from
    ``MLFLOW_AUTH_ADMIN_PASSWORD`` in the server's environment, used when the admin is first
    created). An authenticated user may read everything and write what it created
    (``default_permission`` READ; the ``pipeline`` user, created by
    :func:`ensure_mlflow_pipeline_user`, creates the pipeline's experiments and models, so it
    manages them). A checked password is cached for 5 minutes: MLflow hashes it with PBKDF2 per
    request otherwise (~0.3 s on these machines)."""
    config = configparser.ConfigParser()
    config["mlflow"] = {"default_permission": "READ", "database_uri": database_uri, "admin_username": MLFLOW_ADMIN,
                        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
                        "auth_cache_ttl_seconds": "300"}
    text = io.StringIO()
    config.write(text)
    return text.getvalue()


def ensure_mlflow_pipeline_user(tracking_uri: str, admin_password: str, password: str) -> None:
    """The pipeline's MLflow user (``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` of the steps),
    created once by the admin, with MANAGE on MLflow's Default experiment and on the pipeline's
    experiment and registered model where they already exist (created before the server asked
    for logins); what it creates later it manages anyway."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.server.auth.client import AuthServiceClient

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(MLFLOW_TRACKING_USERNAME=MLFLOW_ADMIN, MLFLOW_TRACKING_PASSWORD=admin_password)
    try:
        admin = AuthServiceClient(tracking_uri)
        try:
            admin.get_user(MLFLOW_PIPELINE_USER)
            admin.update_user_password(MLFLOW_PIPELINE_USER, password)  # the steps' password as configured now
        except RestException:  # RESOURCE_DOES_NOT_EXIST: the first start
            admin.create_user(MLFLOW_PIPELINE_USER, password)
        except MlflowException as exc:
            if " 404 " in f" {exc} ":  # a page, not MLflow's JSON: no auth app behind this address
                raise StackError(f"MLflow at {tracking_uri} asks for no login (a server started by older code: "
                                 "stop it and start the stack again)") from None
            if " 401 " in f" {exc} ":
                raise StackError(f"MLflow at {tracking_uri} refused the admin's login: its password is fixed "
                                 "when MLflow's auth database is first created (keep MLFLOW_ADMIN_PASSWORD, or "
                                 "the stack's secrets.json, as it was then)") from None
            raise
        from mlflow import MlflowClient

        settings = load()
        experiment = MlflowClient(tracking_uri).get_experiment_by_name(settings.train.experiment)
        # and MLflow's Default experiment (0, created with the database): runs started without one
        grants = [("experiment", "0"), *([("experiment", experiment.experiment_id)] if experiment else [])]
        with contextlib.suppress(MlflowException):  # absent: the pipeline creates it, so it manages it
            MlflowClient(tracking_uri).get_registered_model(settings.pipeline.model_name)
            grants.append(("registered_model", settings.pipeline.model_name))
        for resource_type, resource in grants:
            with contextlib.suppress(RestException):  # RESOURCE_ALREADY_EXISTS: granted at an earlier start
                admin.grant_user_permission(MLFLOW_PIPELINE_USER, resource_type, resource, "MANAGE")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mlflow_command() -> list[str]:
    root = state_dir() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return [
        bin_path("mlflow"),
        "server",
        "--app-name",
        "basic-auth",  # logins required (mlflow_auth_config)
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        "s3://mlflow/artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(ports()["mlflow"]),
        "--workers",
        "1",
    ]


def mlflow_env() -> dict[str, str]:
    env = client_env()
    root = state_dir() / "mlflow"
    config = root / "basic_auth.ini"
    config.write_text(mlflow_auth_config(f"sqlite:///{root / 'basic_auth.db'}"))
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": secret("mlflow_admin"),  # used when the admin is first created
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secret("mlflow_flask"),  # the auth app's CSRF tokens
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": env["AWS_DEFAULT_REGION"],
        "MLFLOW_S3_ENDPOINT_URL": env["AWS_ENDPOINT_URL"],
        # the job-execution helpers cost ~2 GB of memory and the pipeline does not use them
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
