"""The kernel dispatch registry: which implementation each op runs per backend, Triton imported only when asked
for, and no import cycle among the kernel modules."""

import ast
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

import tiffin.kernels
import tiffin.kernels.lora
import tiffin.kernels.quant
from tiffin.kernels.dispatch import implements, kernel

TRITON_OPS = [
    "write_kv",
    "paged_attention",
    "lora_shrink",
    "lora_expand",
    "lora_apply",
    "awq_gemm",
    "gptq_gemm",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary_write_kv",
]


def test_each_backend_runs_its_own_implementation_or_torchs():
    for op in TRITON_OPS:  # every op has its Triton kernel (the fused decode-layer ops since #25)
        own = kernel(op, "torch")
        assert own.__module__.startswith("tiffin.kernels") and own.__name__ == f"{op}_torch"
        assert kernel(op, "triton").__name__ == f"{op}_triton"


def test_an_op_implemented_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        implements("rms_norm", "torch")(lambda x, weight, eps: x)


@pytest.mark.subprocess
def test_torch_path_never_imports_triton():
    code = (
        "import sys, torch, tiffin, tiffin.engine.llm_engine, tiffin.kernels.lora, tiffin.kernels.quant\n"
        "from tiffin import kernels\n"
        "kernels.silu_and_mul(kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6))\n"
        "sys.exit('triton' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_kernel_modules_import_one_way():
    """Imports anywhere in a module's code count, function-level ones included: a cycle that only works
    because one side imports lazily is still a cycle."""
    root = Path(tiffin.kernels.__file__).parent
    modules = {p.stem for p in root.glob("*.py")} - {"__init__"}
    graph = {}
    for name in modules:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tiffin.kernels":
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tiffin.kernels."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("tiffin.kernels.")}
        graph[name] = deps & modules - {name}  # compile_check's __main__ imports its registry copy
    list(TopologicalSorter(graph).static_order())  # raises CycleError naming the cycle
