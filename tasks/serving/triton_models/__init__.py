"""Triton python-backend models, copied into each version folder of the model repository by
the export step (``<repository>/<model>/<version>/model.py``). They run inside Triton's python
stub, not in the pipeline's processes: imports are limited to numpy, onnxruntime, tokenizers
and ``triton_python_backend_utils``."""
