"""Tensor parallelism: the rank descriptor every sharded layer takes (`TensorParallel`), the worker processes
and their collectives (`WorkerGroup`), and the wire format of a step (`wire`). It knows neither models nor
steps: the worker package gives the group its entry point and encodes what crosses."""
