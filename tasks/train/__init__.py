"""The train step: the GPT trained with FSDP2 (default) / DDP / DeepSpeed / one process, under
``torchrun``, with sharded resumable checkpoints and MLflow tracking.

- ``__main__.py``: the command line (``python -m tasks.train``);
- ``trainer.py``: :class:`~tasks.train.trainer.Trainer` (the loop), ``TrainState``, and
  ``train()``, which builds a run from the settings and publishes the consolidated model;
- ``engines.py``: one class per ``train.engine``, chosen once from a table;
- ``checkpoint.py``: the checkpoint store and one format per engine kind (DCP, DeepSpeed);
- ``meters.py``: throughput, time shares and MFU.

The settings are ``tasks.config.TrainSettings`` (params.yaml ``train``).
"""
