"""The settings of ``params.yaml``, typed: one frozen dataclass per section, read once.

``params.yaml`` holds the values (the one source of settings); these classes hold their types,
their allowed values and their checks, so a misspelt key, a string where a number belongs or an
engine that does not exist is refused once, when the file is read, naming the setting:

    >>> settings = load(section="train", overrides=["lr=0.001"])   # a step and its --set
    >>> settings.train.lr, settings.pipeline.model_name
    (0.001, 'llm-retrain')

Standard library only (PyYAML is imported by :func:`load`, which both images have): the DAGs
take their Params' choices from the same ``Literal`` types (:func:`choices`) without importing
a step. Each field's docstring is its documentation; docs/configuration.md's reference is
generated from them (``python -m tasks.config --markdown``), so it cannot drift. Torchtitan's
``JobConfig`` is the model followed.

One module per concern, their public names re-exported here (``from tasks.config import X``):
the sections (``pipeline``, ``data``, ``training``, ``evaluation``, ``serving``, ``canary``,
``drift``; ``settings``: the whole file), what they share (``base``), building them from YAML
(``coerce``), model lines (``lines``: a line's file over params.yaml), reading params.yaml with
a line and a step's overrides (``load``), the reference (``reference``) and the command line
(``__main__``).
"""

from tasks.config.base import REPO_ROOT, SettingsError
from tasks.config.canary import Approval, CanarySettings
from tasks.config.coerce import build, choices, describe
from tasks.config.data import ReproSettings, SeedSettings, SnapshotSettings, TokenizeSettings, ValidateSettings
from tasks.config.drift import DriftSettings
from tasks.config.evaluation import EvaluateSettings, GateLimits, SuiteSettings, TaskGate
from tasks.config.lines import (
    DEMO,
    DEMO_LABEL,
    LINE_ENV,
    LINES_DIR_ENV,
    current_line,
    line_dag_id,
    line_label,
    line_path,
    lines,
    lines_dir,
)
from tasks.config.load import apply_overrides, every_line, load, params_path, read_yaml
from tasks.config.pipeline import (
    IngestSettings,
    KubernetesLauncher,
    LauncherMode,
    LauncherSettings,
    PipelineSettings,
    PodKind,
    Pool,
    RemoteLogs,
    StackSettings,
    TaskSettings,
    TrainingJob,
)
from tasks.config.reference import reference, with_reference
from tasks.config.serving import (
    Backend,
    Capture,
    ExportSettings,
    Gateway,
    Generate,
    Network,
    Queue,
    Range,
    Router,
    ServeKubernetes,
    ServeSettings,
    TensorRT,
)
from tasks.config.settings import Settings
from tasks.config.training import Engine, InitFrom, Precision, Preset, Switch, TrainSettings

__all__ = [
    "DEMO", "DEMO_LABEL", "LINES_DIR_ENV", "LINE_ENV", "REPO_ROOT", "Approval", "Backend", "CanarySettings", "Capture", "DriftSettings", "Engine", "EvaluateSettings",
    "ExportSettings", "GateLimits", "Gateway", "Generate", "IngestSettings", "InitFrom", "KubernetesLauncher",
    "LauncherMode", "LauncherSettings", "Network", "PipelineSettings", "PodKind", "Pool", "Precision", "Preset",
    "Queue", "Range", "RemoteLogs", "ReproSettings", "Router", "SeedSettings", "ServeKubernetes", "ServeSettings",
    "Settings", "SettingsError", "SnapshotSettings", "StackSettings", "SuiteSettings", "Switch", "TaskGate",
    "TaskSettings", "TensorRT", "TokenizeSettings", "TrainSettings", "TrainingJob", "ValidateSettings",
    "apply_overrides", "build", "choices", "current_line", "describe", "every_line", "line_dag_id", "line_label", "line_path",
    "lines", "lines_dir", "load", "params_path", "read_yaml", "reference", "with_reference",
]
