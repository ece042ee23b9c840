"""`tiffin quantize` plumbing that runs without the tools (CI has no autoawq/gptqmodel; the tools themselves
ran when the fixtures were made, see tests/fixtures/quant/regenerate.py)."""

import sys

import pytest
from transformers import AutoTokenizer

from tiffin import cli
from tiffin.quant import tools


def test_calibration_samples_are_exact_windows(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    text = "def f(x):\n    return x + 1\n" * 200
    ids = tok.encode(text, add_special_tokens=False)
    samples = tools.calibration_samples(tok, text, num_samples=5, seq_len=37)
    assert len(samples) == 5 and all(len(s) == 37 for s in samples)  # never dropped by max_calib_seq_len
    assert sum(samples, []) == ids[: 5 * 37]
    with pytest.raises(ValueError, match="fewer than one sample"):
        tools.calibration_samples(tok, "short", num_samples=5, seq_len=512)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="exl2"), "method must be"),
        (dict(method="awq", bits=8), "AWQ takes 4 bits"),
        (dict(method="awq", group_size=-1), "AWQ takes 4 bits"),
        (dict(method="gptq", bits=3), "GPTQ takes bits"),
        (dict(method="gptq", checkpoint_format="marlin"), "GPTQ takes bits"),
        (dict(method="gptq", modules_to_not_convert=["o_proj"]), "AWQ option"),
        (dict(method="gptq", num_samples=0), "num_samples"),
    ],
)
def test_bad_arguments_fail_before_loading(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tools.quantize(tmp_path / "missing-model", tmp_path / "out", calib=tmp_path / "missing.txt", **kwargs)


@pytest.mark.parametrize("method, module", [("awq", "awq"), ("gptq", "gptqmodel")])
def test_missing_tool_names_the_extra(tiny_model, tmp_path, monkeypatch, method, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    calib = tmp_path / "calib.txt"
    calib.write_text("some calibration text " * 50)
    with pytest.raises(ImportError, match=r"tiffin\[quantize\]"):
        tools.quantize(tiny_model("llama"), tmp_path / "out", method, calib, group_size=64, seq_len=16, num_samples=2)


def test_cli_passes_options_through(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(tools, "quantize", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs) or "out")
    cli.main(
        [
            "quantize",
            "in",
            "out",
            "--method",
            "gptq",
            "--calib",
            "c.txt",
            "--bits",
            "8",
            "--group-size",
            "-1",
            "--desc-act",
            "--asym",
            "--format",
            "gptq_v2",
            "--num-samples",
            "3",
            "--seq-len",
            "9",
        ]
    )
    assert seen["args"] == ("in", "out", "gptq", "c.txt")
    assert seen["kwargs"] == dict(
        bits=8,
        group_size=-1,
        desc_act=True,
        sym=False,
        checkpoint_format="gptq_v2",
        modules_to_not_convert=None,
        num_samples=3,
        seq_len=9,
        device=None,
    )
