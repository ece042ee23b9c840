"""Tensor and pipeline parallelism: the rank descriptors every sharded layer (`TensorParallel`) and every staged
model (`PipelineParallel`) takes, the worker processes and their collectives (`WorkerGroup`), and the wire format
of a step (`wire`). It knows neither models nor steps: the worker package gives the group its entry point and
encodes what crosses."""
