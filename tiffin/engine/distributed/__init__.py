"""Tensor and pipeline parallelism: the rank descriptors every sharded layer (`TensorParallel`) and every staged
model (`PipelineParallel`) takes, the worker processes or Ray actors and their collectives (`WorkerGroup`; the
`ray` executor in `ray_executor`, imported only when chosen), and the wire format of a step (`wire`). It knows
neither models nor steps: the worker package gives the group its entry point and encodes what crosses."""
