"""Pipeline steps, each run as ``python -m tasks.<step>``. Never imports Airflow.

Importing the package turns off the usage telemetry that the libraries the steps use send by
default from every process (MLflow's client, DVC's analytics daemon, started beside each DVC
command, Great Expectations', the Hugging Face Hub's): a pipeline run reports to no vendor. A
variable already set in the environment is kept, so a deployment may opt in."""

import os

NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false",
                "HF_HUB_DISABLE_TELEMETRY": "1"}
for _name, _value in NO_TELEMETRY.items():
    os.environ.setdefault(_name, _value)
