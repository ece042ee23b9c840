"""benchmarks/gpu_smoke.sh runs only where a GPU is lent, rarely: here, on every CI run, everything it names is
checked to still exist, so that it cannot go stale silently: the repository files it reads, the pytest files and
`-k` tests it selects (collected), the options it passes to each script (the repository's and those it writes),
and the scripts it writes (they compile; their `from tiffin...` names and the kernel tests' helpers they use
resolve)."""

import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "benchmarks" / "gpu_smoke.sh"
TEXT = SMOKE.read_text()
# the Python scripts it writes: name -> source
WRITTEN = dict(
    re.findall(r"cat > \"\$WORK/py/([\w.]+)\" <<'TIFFIN_SMOKE_PY_EOF'\n(.*?)\nTIFFIN_SMOKE_PY_EOF", TEXT, re.S)
)
SHELL = re.sub(r"<<'TIFFIN_SMOKE_PY_EOF'\n.*?\nTIFFIN_SMOKE_PY_EOF", "", TEXT, flags=re.S)  # the bash alone


def test_it_writes_the_scripts_it_runs():
    assert set(WRITTEN) == {"gpu_checks.py", "step_anatomy.py", "make_1b.py", "tput.py", "summary.py", "load7b.py"}
    for name in re.findall(r"\$WORK/py/([\w.]+)", SHELL):
        assert name in WRITTEN, name
    assert subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True).returncode == 0


def test_every_repository_path_exists():
    paths = set(re.findall(r"\b((?:tests|benchmarks|tiffin)/[\w/.-]+\.(?:py|sh|toml|md))", TEXT))
    assert "tests/engine/test_engine_parity.py" in paths and "benchmarks/throughput.py" in paths
    for path in sorted(paths):
        assert (REPO / path).exists(), f"gpu_smoke.sh names {path}, which does not exist"
    for where in re.findall(r'Path\("((?:tests|benchmarks)[\w/]*)"\)', TEXT):
        assert (REPO / where).is_dir(), where
    for module in re.findall(r"-m (tiffin[\w.]*)", SHELL):
        assert importlib.util.find_spec(module) is not None, module


def _pytest_runs() -> list[tuple[list[str], str | None]]:
    """(test files, -k expression) of each pytest run: a line that runs "${PT[@]}", with its continuation."""
    runs = []
    for line in re.sub(r"\\\n\s*", " ", SHELL).splitlines():
        if '"${PT[@]}"' in line:
            words = shlex.split(line.split('"${PT[@]}"', 1)[1])
            files = [w for w in words if w.startswith("tests/")]
            k = words[words.index("-k") + 1] if "-k" in words else None
            runs.append((files, k))
    return runs


def test_every_pytest_run_collects_what_it_names():
    runs = _pytest_runs()
    assert len(runs) >= 5
    for files, k in runs:
        assert files
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        ids = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert ids.returncode == 0, ids.stdout[-3000:] + ids.stderr[-3000:]
        collected = [line for line in ids.stdout.splitlines() if "::" in line]
        for f in files:
            assert any(line.startswith(f + "::") for line in collected), f"{f} collects no test"
        for name in re.findall(r"\btest_\w+", k or ""):  # a renamed test would make "not <name>" select it again
            named = re.compile(rf"::{name}(\[|$)")
            assert any(named.search(line) for line in collected), f"-k names {name}, which is not collected"


def _options_of(source: str) -> set[str]:
    return set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)""", source))


def _arrays() -> dict[str, set[str]]:
    """The options each bash array of arguments holds, in any of its assignments."""
    arrays: dict[str, set[str]] = {}
    for name, body in re.findall(r"\b(\w+)\+?=\(([^)]*)\)", SHELL):
        arrays.setdefault(name, set()).update(re.findall(r"(?<![\w-])(--[\w-]+)", body))
    return arrays


def test_every_option_passed_to_a_script_is_one_it_takes():
    arrays = _arrays()
    accepted = {f"benchmarks/{p.name}": _options_of(p.read_text()) for p in (REPO / "benchmarks").glob("*.py")}
    accepted |= {f"$WORK/py/{name}": _options_of(source) for name, source in WRITTEN.items()}
    accepted["$WORK/py/make_1b.py"] = set(re.findall(r'"(--[\w-]+)" in sys.argv', WRITTEN["make_1b.py"]))
    # tput.py takes --vllm-graphs itself, the rest (after --) is benchmarks/throughput.py's
    accepted["$WORK/py/tput.py"] = {"--vllm-graphs"} | accepted["benchmarks/throughput.py"]
    accepted["${CHECKS[@]}"] = accepted["$WORK/py/gpu_checks.py"]
    checked = 0
    for line in re.sub(r"\\\n\s*", " ", SHELL).splitlines():
        script = next((s for s in accepted if s in line and not line.lstrip().startswith("#")), None)
        if script is None:
            continue
        after = line.split(script, 1)[1]
        options = set(re.findall(r"(?<![\w-])(--[\w-]+)", after))
        for name in re.findall(r"\$\{(\w+)\[@\]", after):
            options |= arrays.get(name, set()) if name not in ("PT", "TASKSET") else set()
        if script == "${CHECKS[@]}":
            options |= arrays["CHECKS"]
        unknown = options - accepted[script]
        assert not unknown, f"gpu_smoke.sh passes {sorted(unknown)} to {script}, which does not take them: {line}"
        checked += 1
    assert checked >= 10


def _test_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_written_script_compiles_and_its_names_resolve(name):
    pytest.importorskip("torch")
    tree = ast.parse(WRITTEN[name], name)
    compile(tree, name, "exec")
    aliases = {}  # test modules it imports, by their alias
    search = re.findall(r'sys\.path\.insert\(0, str\(Path\("([\w/]+)"\)', WRITTEN[name])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tiffin"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{name}: from {node.module} import {alias.name}"
                )
        if isinstance(node, ast.Import):
            for alias in node.names:
                if list(REPO.glob(f"tests/**/{alias.name}.py")):  # a test module: from the path the script sets
                    found = [d for d in search if (REPO / d / f"{alias.name}.py").exists()]
                    assert found, f"{name}: import {alias.name}, not in {search}, the directories it puts on sys.path"
                    aliases[alias.asname or alias.name] = _test_module(REPO / found[0] / f"{alias.name}.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            assert hasattr(aliases[node.value.id], node.attr), f"{name}: {node.value.id}.{node.attr}"
