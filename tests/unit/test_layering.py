"""The layering of docs/architecture.md, executable: every import in `tiffin/` (function-level ones included)
points down this list or within its own layer, and no modules import each other in a cycle."""

import ast
from pathlib import Path

import tiffin

# highest first; a module belongs to the layer of its longest listed prefix
LAYERS = [
    ("entry points outside the engine", ["tiffin", "tiffin.cli", "tiffin.testing"]),
    ("serving", ["tiffin.plugin"]),
    (
        "engine entry points",
        [
            "tiffin.engine",
            "tiffin.engine.llm",
            "tiffin.engine.llm_engine",
            "tiffin.engine.async_llm_engine",
            "tiffin.engine.data_parallel",
            "tiffin.engine.chat",
        ],
    ),
    ("speculative decoding", ["tiffin.engine.spec_decode"]),
    (
        "engine boxes",
        [
            "tiffin.engine.core",
            "tiffin.engine.router",
            "tiffin.engine.worker",
            "tiffin.engine.lora",
            "tiffin.engine.structured",
            "tiffin.engine.multimodal.encoder",
            "tiffin.engine.multimodal.mrope",
        ],
    ),
    ("models", ["tiffin.engine.models"]),
    ("tensor parallelism", ["tiffin.engine.distributed"]),
    (
        "request vocabulary",
        [
            "tiffin.engine.config",
            "tiffin.engine.speculative_config",
            "tiffin.engine.errors",
            "tiffin.engine.kv_events",
            "tiffin.engine.sampling_params",
            "tiffin.engine.pooling_params",
            "tiffin.engine.outputs",
            "tiffin.engine.reasoning",
            "tiffin.engine.structured.params",
            "tiffin.engine.structured.limits",
            "tiffin.engine.structured.formats",
            "tiffin.engine.multimodal.image",
            "tiffin.engine.multimodal.tiles",
            "tiffin.engine.multimodal.patches",
            "tiffin.engine.multimodal.fixed_size",
            "tiffin.engine.multimodal.inputs",
        ],
    ),
    ("quantization formats", ["tiffin.quant"]),
    ("kernels", ["tiffin.kernels"]),
    (
        "assets",
        ["tiffin.tiny", "tiffin.tiny_bert", "tiffin.smollm2", "tiffin.minilm", "tiffin.pypi_models", "tiffin.cache"],
    ),
]
ROOT = Path(tiffin.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the tiffin modules it imports anywhere in its body."""
    modules = {module_name(p): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:  # `from pkg import module` imports the module
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) < layer_of(a)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_catch_an_injected_cycle_and_an_upward_import():
    graph = import_graph()
    with_cycle = {
        **graph,
        "tiffin.engine.core.sequence": graph["tiffin.engine.core.sequence"] | {"tiffin.engine.core.scheduler"},
    }
    assert any("tiffin.engine.core.sequence" in c and "tiffin.engine.core.scheduler" in c for c in cycles(with_cycle))
    upward = {**graph, "tiffin.kernels.attention": graph["tiffin.kernels.attention"] | {"tiffin.engine.core.sequence"}}
    assert upward_imports(upward) == [
        "tiffin.kernels.attention (kernels) imports tiffin.engine.core.sequence (engine boxes)"
    ]
