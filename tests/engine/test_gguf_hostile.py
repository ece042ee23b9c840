"""Hostile GGUF files: a valid tiny one edited in place (absurd counts, lengths, shapes and offsets, truncations,
metadata the tensors do not back), each refused with a ValueError naming the field, within 2 s and without
large allocation. They run in one fresh interpreter, so the peak RSS it reports is theirs (tracemalloc gives
each file's own peak), and an alarm ends a read that would run on."""

import json
import re
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType
from gguf_files import write_gguf

pytestmark = pytest.mark.subprocess

SECONDS, MEMORY_MB = 2.0, 32  # per file
# the parts of a tensor info and of a metadata entry (`GGUFReader`'s ReaderField.parts)
N_DIMS, DIMS, TYPE, OFFSET = 2, 3, 4, 5
KEY_LENGTH, KEY, VALUE_TYPE, LENGTH, ITEMS, FIRST_ITEM_LENGTH = 0, 1, 2, 3, 4, 5

READ = """
import json, resource, signal, sys, time, tracemalloc
from tiffin.engine.models.loader import get_model_config

def timed_out(*_):
    raise TimeoutError("still reading after 5 s")

signal.signal(signal.SIGALRM, timed_out)
get_model_config(sys.argv[1])  # the valid file: imports and first uses out of the measurements
# a runaway read fails with MemoryError past 1 GiB more, rather than take the machine's memory
mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.RLIM_INFINITY))
tracemalloc.start()  # each file's own peak (the process's peak RSS only grows past the highest so far)
results = {}
for path in sys.argv[2:]:
    tracemalloc.reset_peak()
    before, start, error = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter(), None
    signal.alarm(5)
    try:
        get_model_config(path)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    seconds, traced = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    results[path] = {"error": error, "seconds": seconds, "rss_mb": grown / 1024, "traced_mb": traced / 2**20}
print(json.dumps(results))
"""


def _set(locate, value):
    def edit(path):
        reader = gguf.GGUFReader(path, "r+")
        locate(reader)[...] = value
        reader.data.flush()

    return edit


def metadata(key, value, part=-1):
    """Edit: part `part` of metadata entry `key` (default: its value) set to `value`."""
    return _set(lambda r: r.fields[key].parts[part], value)


def tensor_info(index, part, value):
    return _set(lambda r: r.tensors[index].field.parts[part], value)


def renamed_tensor(index, name):
    return tensor_info(index, 1, np.frombuffer(name.encode(), np.uint8))


def overwritten(offset, data):
    def edit(path):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    return edit


def truncated(size):
    """Edit: the file cut to `size` bytes (negative: that many fewer)."""

    def edit(path):
        with open(path, "r+b") as f:
            f.truncate(size if size >= 0 else f.seek(0, 2) + size)

    return edit


# case -> (edit of the valid file, what the refusal must say); in the valid file: tensor 0 is output.weight,
# tensor 1 token_embd.weight, tensor 2 blk.0.attn_norm.weight
HEADERS = {
    "magic": (overwritten(0, b"GGUX"), "magic missing: the file starts b'GGUX'"),
    "version": (metadata("GGUF.version", 1, 0), "version 1 is not supported"),
    "tensor_count": (metadata("GGUF.tensor_count", 2**63, 0), "tensor_count is 9223372036854775808"),
    "kv_count": (metadata("GGUF.kv_count", 2**63, 0), "kv_count is 9223372036854775808"),
    "metadata_key_length": (
        metadata("general.name", 2**62, KEY_LENGTH),
        "the key of metadata entry 1 .* declares 2^62",
    ),
    "string_length": (metadata("general.name", 2**62, LENGTH), "general.name's string .* declares 2^62"),
    "template_length": (metadata("tokenizer.chat_template", 2**40, LENGTH), "tokenizer.chat_template's string"),
    "array_length": (metadata("tokenizer.ggml.token_type", 2**61, ITEMS), "tokenizer.ggml.token_type's 2^61 items"),
    "string_array_length": (metadata("tokenizer.ggml.tokens", 2**40, ITEMS), "tokenizer.ggml.tokens's array length"),
    "item_length": (metadata("tokenizer.ggml.tokens", 2**50, FIRST_ITEM_LENGTH), "an item of tokenizer.ggml.tokens"),
    "value_type": (metadata("general.name", 99, VALUE_TYPE), "general.name: unknown value type 99"),
    "n_dims": (tensor_info(0, N_DIMS, 2**31), "tensor 'output.weight' has 2147483648 dimensions"),
    "dims": (tensor_info(0, DIMS, 2**40), "tensor 'output.weight': .* run past the end of the file"),
    "offset": (tensor_info(2, OFFSET, 2**62), "tensor 'blk.0.attn_norm.weight': .* run past the end of the file"),
    "unaligned_offset": (tensor_info(2, OFFSET, 8), "offset 8 is not a multiple of the alignment 32"),
    "tensor_type": (tensor_info(0, TYPE, 200), "tensor 'output.weight' has unknown type 200"),
    "tensor_twice": (renamed_tensor(2, "blk.1.attn_norm.weight"), "tensor 'blk.1.attn_norm.weight' appears twice"),
    **{
        f"truncated_to_{size}": (truncated(size), "(too few|cannot hold|declares|past the end).*truncated")
        for size in (0, 23, 100, 30_000, 65_000, 1_000_000, -1)
    },
}
METADATA = {
    "context_length": (metadata("llama.context_length", 2**32 - 1), "llama.context_length is 4294967295"),
    "vocab_size": (metadata("llama.vocab_size", 2**31), "llama.vocab_size is 2147483648"),
    "vocab_size_in_range": (
        metadata("llama.vocab_size", 2**31 - 1),
        r"not \[2147483647, 64\] \(llama.vocab_size = 2147483647\)",
    ),
    "vocab_below_tokens": (metadata("llama.vocab_size", 1000), "holds 2048 tokens, more than llama.vocab_size"),
    "embedding_length": (metadata("llama.embedding_length", 2**31 - 1), "llama.embedding_length = 2147483647"),
    "feed_forward_length": (metadata("llama.feed_forward_length", 4096), "llama.feed_forward_length = 4096"),
    "head_count_zero": (metadata("llama.attention.head_count", 0), "llama.attention.head_count is 0"),
    "head_count_float": (
        metadata("llama.attention.head_count", GGUFValueType.FLOAT32, VALUE_TYPE),
        r"llama.attention.head_count is 5\.6",
    ),
    "head_count_kv": (metadata("llama.attention.head_count_kv", 3), r"head_count_kv \(3\) does not divide"),
    "attention_key_length": (
        metadata("llama.attention.key_length", 2**20),
        "llama.attention.head_count_kv × llama.attention.key_length = 2 × 1048576",
    ),
    "eos_token_id": (metadata("tokenizer.ggml.eos_token_id", 2**31 - 1), "tokenizer.ggml.eos_token_id is 2147483647"),
    "rms_epsilon": (metadata("llama.attention.layer_norm_rms_epsilon", np.nan), "layer_norm_rms_epsilon is nan"),
    "architecture": (
        metadata("general.architecture", np.frombuffer(b"general.architecturX", np.uint8), KEY),
        "lacks general.architecture",
    ),
    "token_embd_missing": (renamed_tensor(1, "blk.0.attn_q.bias"), "lacks tensor.* token_embd.weight"),
}
BLOCK_COUNTS = {
    "2^31": (metadata("llama.block_count", 2**31), "llama.block_count is 2147483648"),
    "2^31-1": (metadata("llama.block_count", 2**31 - 1), "llama.block_count is 2147483647, but the file holds"),
    "one_more": (metadata("llama.block_count", 3), "llama.block_count is 3, but the file holds tensors of 2 blocks"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, tiny_model):
    """Case -> what reading it in one fresh interpreter gave: error, seconds, growth of the peak RSS and peak
    traced allocation (MB)."""
    root = tmp_path_factory.mktemp("hostile")
    valid = write_gguf(tiny_model("llama"), root / "valid.gguf", QType.F32)
    cases = {**HEADERS, **METADATA, **BLOCK_COUNTS}
    assert len(cases) == len(HEADERS) + len(METADATA) + len(BLOCK_COUNTS)  # one file per case
    paths = {}
    for name, (edit, _) in cases.items():
        paths[name] = root / f"{name}.gguf"
        shutil.copy(valid, paths[name])
        edit(paths[name])
    out = subprocess.run(
        [sys.executable, "-c", READ, str(valid), *map(str, paths.values())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.splitlines()[-1])
    return {name: results[str(path)] for name, path in paths.items()}


def refused(result: dict, match: str) -> None:
    match = re.sub(r"2\^(\d+)", lambda m: str(2 ** int(m[1])), match)
    assert result["error"] is not None and result["error"].startswith("ValueError: "), result
    assert re.search(match, result["error"]), result
    assert result["seconds"] < SECONDS and max(result["rss_mb"], result["traced_mb"]) < MEMORY_MB, result


@pytest.mark.parametrize("case", HEADERS)
def test_headers_declaring_more_than_the_file_holds_are_refused_before_parsing(refusals, case):
    refused(refusals[case], HEADERS[case][1])


@pytest.mark.parametrize("case", METADATA)
def test_metadata_is_checked_for_bounds_and_against_the_tensors(refusals, case):
    refused(refusals[case], METADATA[case][1])


@pytest.mark.parametrize("case", BLOCK_COUNTS)
def test_block_count_must_match_the_blocks_present(refusals, case):
    refused(refusals[case], BLOCK_COUNTS[case][1])
