"""The command line: exit codes 0/1/2, one-line errors without tracebacks, --help everywhere, and the
tiny template end to end (calibrate -> package -> inspect -> verify -> eval)."""
import subprocess
import sys

import pytest

from sdquant.cli import main

COMMANDS = ["calibrate", "export", "inspect", "verify", "eval", "tune-kernels"]


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sdquant.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_for_every_command(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: sdquant " + cmd in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["calibrate", "--config", "/nonexistent.yaml"], "--config: file not found"),
    (["inspect", "/nonexistent.sd2"], "cannot open"),
    (["verify", "/nonexistent.sd2"], "cannot open"),
    (["eval", "tiny-llama", "--text", "/nonexistent.txt"], "--text: file not found"),
    (["export", "/nonexistent.sd2", "--format", "onnx", "--output", "x"], "file not found"),
    (["tune-kernels", "--output", "t.json", "--budget-s", "0"], "--budget-s: must be positive"),
    pytest.param(["tune-kernels", "--output", "/nonexistent-dir/t.json"], "needs a CUDA GPU",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    cap = capsys.readouterr()
    msg = (cap.err + cap.out).strip()  # verify reports its findings on stdout
    assert needle in msg and "\n" not in msg and "Traceback" not in msg


def test_bad_config_field_exits_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {kind: builtin, name: tiny-llama}\nquant: {bitz: 4}\n")
    assert main(["calibrate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sdquant: error: quant.bitz: unknown key (did you mean 'bits'?)"


def test_garbage_package_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.sd2"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    assert main(["inspect", str(bad)]) == 2
    assert main(["verify", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_dump_config(repo, capsys):
    assert main(["calibrate", "--config", str(repo / "templates/tiny-rtn.yaml"), "--set", "quant.bits=3",
                 "--dump-config"]) == 0
    out = capsys.readouterr().out
    assert "bits: 3" in out and "method: rtn" in out


def test_tiny_template_end_to_end(repo, tmp_path):
    pkg = tmp_path / "tiny.sd2"
    r = _run("calibrate", "--config", str(repo / "templates/tiny-rtn.yaml"), "--output", str(pkg),
             "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for needle in ("layers quantized", "14", "linear weights after", "generation (float)", "generation (package)"):
        assert needle in r.stdout
    assert pkg.is_file()
    r = _run("inspect", str(pkg))
    assert r.returncode == 0 and "int4 g32" in r.stdout
    r = _run("verify", str(pkg))
    assert r.returncode == 0 and r.stdout.startswith("OK")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = _run("eval", str(pkg), "--text", str(text), "--seq-len", "64", "--windows", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("perplexity ")
    # a corrupted copy fails verify with exit 2 and names the member
    data = bytearray(pkg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.sd2"
    bad.write_bytes(bytes(data))
    r = _run("verify", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr


LLM_TEMPLATES = ["quickstart", "awq-gptq-w4-a10", "awq-gptq-w4-a100", "awq-gptq-w4-h100", "awq-gptq-w4-h200",
                 "awq-gptq-w4-mi300", "awq-gptq-w4-multigpu", "fp8-w8a8-h100", "fp8-w8a8-tensorwise-h100"]


@pytest.mark.parametrize("name", LLM_TEMPLATES)
def test_llm_templates_run_end_to_end_on_a_tiny_model(repo, tmp_path, name):
    """Every LLM template's method, act-order, damping, FP8 and pipeline settings run as written; only what
    cannot exist here is redirected: the model (a tiny random Llama), the data size, the device and the
    group size (the tiny model is 64 wide)."""
    import sdquant
    import torch
    from sdquant.config import load_config
    over = {"model.kind": "builtin", "model.name": "tiny-llama", "model.path": None, "data.kind": "builtin",
            "data.path": None, "data.n_samples": 4, "data.seq_len": 32, "device": "cpu", "dtype": "float32",
            "pipeline.memory_budget_gb": None, "output": str(tmp_path / "m.sd2"), "quant.awq.grid": 4,
            "quant.awq.clip_grid": 4}
    cfg = load_config(repo / "templates" / f"{name}.yaml", over)
    if cfg.quant.method != "fp8":
        cfg = cfg.replace(**{"quant.group_size": 32})
    res = sdquant.calibrate(config=cfg)
    assert len(res.weights) == 14 and res.rows
    if cfg.quant.method == "fp8":   # the template's scale granularity reached every weight
        per_tensor = cfg.quant.fp8.weights == "tensor"
        assert all(bool((w.weight_scale == w.weight_scale[0]).all()) == per_tensor for w in res.weights.values())
        assert all((w.input_scale is not None) == (cfg.quant.fp8.activations == "static")
                   for w in res.weights.values())
    q = sdquant.load(sdquant.export(res, cfg.output), device="cpu", dtype=torch.float32)
    if cfg.quant.method == "fp8":   # the loaded layers see the granularity again (tensorwise _scaled_mm on a GPU)
        from sdquant.kernels.linear import Fp8Linear
        tw = cfg.quant.fp8.weights == "tensor" and cfg.quant.fp8.activations == "static"
        layers = [m for m in q.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 14 and all(("tensorwise" in repr(m)) == tw for m in layers)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        got, ref = q(ids).logits, res.model(ids).logits
    if cfg.quant.method == "fp8":
        # W8A8: the package also quantizes activations (per token, e4m3) where calibration's model did not
        assert ((got - ref).norm() / ref.norm()).item() < 0.05
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
