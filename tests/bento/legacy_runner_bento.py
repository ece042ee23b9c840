"""A Bento built the legacy way, `bentoml.runner_service` over tiffin's Runner (served by test_runner.py)."""

import os

import bentoml

from tiffin.plugin.runner import make_runner

runner = make_runner(os.environ["TIFFIN_MODEL"], num_kv_blocks=64)
svc = bentoml.runner_service(runner)
