"""launch/bench.py model mode on CPU with tiny variants: the JSON it writes, its FLOPs, the peer."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax import model_flops
from digen_jax.app import loop
from digen_jax.app.bench import model, peaks, profiler, provenance
from digen_jax.models import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "bench.py")
_spec = importlib.util.spec_from_file_location("bench", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = ["--variant=tiny", "--batch=2", "--height=64", "--width=32", "--text_len=6", "--lora_rank=2",
        "--dtype=float32", "--repeats=1", "--warmup=0", "--matmul_size=64", "--matmul_chain=2"]


def parse(*args):
    bench.flags.FLAGS.unparse_flags()
    bench.flags.FLAGS(["bench.py", *TINY, *args])


def test_model_mode_writes_every_figure(tmp_path, monkeypatch):
    out = tmp_path / "qwen.json"
    parse("--family=qwenimage", "--what=forward,lora_fwd_bwd,full_fwd_bwd", f"--out={out}")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.61")  # restored after the test
    result, path = bench.run_from_flags()
    assert path == str(out)
    written = json.loads(out.read_text())
    assert written["mem_fraction"] == "0.61"  # the share in effect
    assert written["config"]["family"] == "qwenimage" and written["config"]["image_tokens"] == 8
    assert written["device"]["count"] >= 1 and written["device"]["kind"]
    assert written["versions"]["jax"] and written["versions"]["flax"] and "torch" in written["versions"]
    assert set(written["git"]) == {"commit", "dirty"}
    assert written["source_sha256"] == provenance.source_digest() and len(written["source_sha256"]) == 64
    assert written["peaks"]["datasheet_bf16_flops_per_s"] is None  # a CPU has no datasheet entry
    assert written["peaks"]["measured_matmul"]["flops_per_s"] > 0
    assert written["peer"] is None

    cfg = FAMILIES["qwenimage"].variants["tiny"]
    terms = model_flops.model_terms("qwenimage", cfg, batch=2, height=64, width=32, text_len=6)
    want = {
        "forward": terms.forward().total,
        "lora_fwd_bwd": terms.lora_fwd_bwd(2, ATTENTION_MLP_TARGETS["qwenimage"]).total,
        "full_fwd_bwd": terms.full_fwd_bwd().total,
    }
    for what, flop in want.items():
        entry = written["results"][what]
        assert "error" not in entry, entry.get("error")
        assert entry["flops"] == flop == entry["traced_matmul_flops"]  # no remat, XLA attention: exact
        assert entry["flops_breakdown"]["total"] == flop
        assert len(entry["times_s"]) == 1 and entry["median_s"] > 0 and entry["compile_s"] > 0
        assert set(entry["memory_bytes"]) == {"argument", "output", "alias", "temp"}
        assert entry["memory_bytes"]["argument"] > 0 and entry["memory_bytes"]["temp"] > 0
        assert entry["flops_per_s"] == pytest.approx(flop / entry["median_s"])
        assert entry["mfu_datasheet"] is None
        peak = written["peaks"]["measured_matmul"]["flops_per_s"]
        assert entry["mfu_measured_peak"] == pytest.approx(entry["flops_per_s"] / peak)
    assert written["param_count"] == 89328 and written["lora_param_count"] > 0  # docs/models.md: the tiny Qwen-Image


def test_model_mode_fp8_forward_against_bf16(tmp_path):
    """`forward_fp8`: the same model with its block kernels in e4m3 (models/fp8.py), timed and
    compared with the bf16 forward of the same inputs."""
    out = tmp_path / "fp8.json"
    parse("--family=flux", "--what=forward,forward_fp8", "--matmul_size=0", f"--out={out}")
    bench.run_from_flags()
    written = json.loads(out.read_text())
    bf16, fp8 = written["results"]["forward"], written["results"]["forward_fp8"]
    assert "error" not in fp8, fp8.get("error")
    assert fp8["flops"] == bf16["flops"] == fp8["traced_matmul_flops"]
    # The e4m3 kernels and their scales replace the bf16 kernels: fewer argument bytes.
    assert fp8["memory_bytes"]["argument"] < bf16["memory_bytes"]["argument"]
    assert written["fp8"]["speedup_vs_bf16"] == pytest.approx(bf16["median_s"] / fp8["median_s"])
    assert fp8["matmul_custom_calls"] == {}  # the CPU backend emits its own dots, no library GEMMs
    hlo = 'x = f32[2] custom-call(a, b), custom_call_target="__cublas$lt$matmul$f8", y = custom_call_target="__cublas$lt$matmul$f8"'
    assert model.matmul_custom_calls(hlo) == {"__cublas$lt$matmul$f8": 2}
    # e4m3 keeps 3 mantissa bits: a few percent of error, never zero (the kernels are quantised).
    assert 1e-4 < written["fp8"]["velocity_rel_err"] < 0.1


def test_model_mode_unrolled_blocks_time_the_same_program(tmp_path):
    """`--scan_layers=false`: weights and adapters drawn stacked, then split per block."""
    written = {}
    for scan in ("true", "false"):
        out = tmp_path / f"scan_{scan}.json"
        parse("--family=flux", "--what=lora_fwd_bwd", f"--scan_layers={scan}", "--matmul_size=0", f"--out={out}")
        bench.run_from_flags()
        written[scan] = json.loads(out.read_text())
    scanned, unrolled = written["true"], written["false"]
    assert unrolled["config"]["model"]["scan_layers"] is False
    entry = unrolled["results"]["lora_fwd_bwd"]
    assert "error" not in entry, entry.get("error")
    # Unrolled, autodiff drops the gradient w.r.t. the first block's input (nothing before it
    # trains); the scanned body computes it for every layer, so it is in the exact count.
    traced = scanned["results"]["lora_fwd_bwd"]["traced_matmul_flops"]
    assert traced == entry["flops"] == scanned["results"]["lora_fwd_bwd"]["flops"]
    assert 0.9 * traced < entry["traced_matmul_flops"] < traced
    assert unrolled["param_count"] == scanned["param_count"]
    assert unrolled["lora_param_count"] == scanned["lora_param_count"] > 0


@pytest.mark.parametrize("family", sorted(FAMILIES.keys() & set(model_flops.FORMULAS)))
def test_peer_runs_the_diffusers_module(family, tmp_path):
    """The PyTorch peer in-process: the same config and shapes, LoRA on the same layers."""
    frames = ["--frames=5"] if family in ("wan", "hunyuan_video") else []
    parse(f"--family={family}", "--what=forward,forward_fp8,lora_fwd_bwd", *frames)
    bench.run_peer(str(tmp_path / "peer.json"))
    peer = json.loads((tmp_path / "peer.json").read_text())
    assert "forward_fp8" not in peer["results"]  # the peer has no FP8 path
    for what in ("forward", "lora_fwd_bwd"):
        entry = peer["results"][what]
        assert "error" not in entry, entry.get("error")
        assert entry["median_s"] > 0 and entry["flops_per_s"] > 0
    assert peer["results"]["lora_fwd_bwd"]["lora_impl"] in ("peft", "manual")


def test_peer_subprocess_and_ratio(tmp_path):
    out = tmp_path / "wan.json"
    parse("--family=wan", "--frames=5", "--what=forward", "--peer", f"--out={out}")
    result, _ = bench.run_from_flags()
    assert "error" not in result["peer"], result["peer"].get("error")
    assert result["peer_ratio"]["forward"] == pytest.approx(
        result["peer"]["results"]["forward"]["median_s"] / result["results"]["forward"]["median_s"]
    )


def test_bad_flags_fail_before_device_work():
    parse("--family=wan", "--frames=4")
    with pytest.raises(ValueError, match="4k \\+ 1"):
        bench.run_from_flags()
    parse("--family=flux", "--what=forward,backward")
    with pytest.raises(ValueError, match="--what"):
        bench.run_from_flags()


@pytest.mark.parametrize("args, error", [
    (["--mode=model", "--family=flux", "--seq_parallel=2"], "error: --seq_parallel=2: sequence parallelism is built for"),
    (["--mode=model", "--family=wan", "--frames=5", "--seq_parallel=16"], "error: --seq_parallel=16: sequence parallelism over 16"),
    (["--mode=model", "--family=wan", "--frames=5", "--height=480", "--width=800", "--seq_parallel=10"],
     "error: --seq_parallel=10 needs 10 devices; this host has 8"),
    (["--mode=system", "--config=configs/tiny.py", "--modes=colocated,gap+bogus"], "error: --modes: runtime.mode='gap+bogus'"),
    (["--mode=system", "--config=configs/tiny.py", "--iterations=0"], "error: --warmup_iterations must be >= 0 and --iterations >= 1"),
])
def test_the_script_names_a_bad_flag_in_one_line(args, error, tmp_path):
    """What the user runs: a bench that cannot run ends with one `error:` line naming the flag and
    status 1, no traceback, before any model is built or the matmul peak measured."""
    proc = subprocess.run([sys.executable, SCRIPT, *args, f"--workdir={tmp_path}", f"--out={tmp_path / 'x.json'}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and proc.stderr.rstrip().splitlines()[-1].startswith(error), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "matmul peak" not in proc.stdout, proc.stdout[-2000:]
    assert not (tmp_path / "x.json").exists()


def test_the_matmul_peak_is_measured_off_a_cpu_unless_asked():
    """Unset `--matmul_size`: 8192 on a GPU or TPU, skipped on a CPU (minutes there, and no MFU is
    read against a CPU's peak); a size given is kept, 0 skipping everywhere."""
    assert peaks.matmul_size_for(None, "gpu") == peaks.matmul_size_for(None, "tpu") == 8192
    assert peaks.matmul_size_for(None, "cpu") == 0
    assert peaks.matmul_size_for(64, "cpu") == 64 and peaks.matmul_size_for(0, "gpu") == 0


def test_datasheet_peaks():
    assert peaks.datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peaks.datasheet_peak("NVIDIA H200") == 989.4e12
    assert peaks.datasheet_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert peaks.datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert peaks.datasheet_peak("cpu") is None


def test_help_documents_the_flags():
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1) and "Model level (`--mode=model`)" in proc.stdout, proc.stderr  # absl exits 1
    for flag in ("--mode", "--family", "--variant", "--batch", "--height", "--width", "--frames", "--text_len",
                 "--what", "--lora_rank", "--remat_policy", "--attention_impl", "--dtype", "--repeats",
                 "--warmup", "--out", "--peer"):
        assert flag in proc.stdout, flag


def _tiny_qwenimage_config(path, overrides: str = "", module: str = "qwenimage"):
    """A config file: configs/<module>.py:tiny (a Qwen-Image config) with one block, then the
    `overrides` lines."""
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
        f"import {module}\n\n"
        "def get_config():\n"
        f"    c = {module}.get_config('tiny')\n"
        "    c.model.num_layers = 1\n"
        f"{overrides}"
        "    return c\n"
    )
    return path


def test_system_mode_writes_every_mode_with_costs_and_traces(tmp_path, capsys):
    """Every requested schedule mode from one run: rates, measured task costs the simulator reads
    (colocated included), the splits of the timed iterations, and the traces next to the JSON,
    written after each mode (a run cut short keeps the modes it finished)."""
    from digen_jax.runtime import simulator
    from digen_jax.runtime.trace import read_trace

    out = tmp_path / "system.json"
    modes = ["colocated", "gap+tsp+tag+tcss"]
    config_file = _tiny_qwenimage_config(
        tmp_path / "system_config.py",
        "    c.runtime.rollout_devices, c.runtime.micro_batches = 4, 2  # the other 4 train\n"
        "    c.rl.prompts_per_iteration, c.rl.grad_chunk_size = 4, 4\n",
    )
    parse(
        "--mode=system", f"--config={config_file}", f"--modes={','.join(modes)}", "--iterations=2",
        f"--workdir={tmp_path / 'work'}", f"--out={out}",
    )
    result, path = bench.run_from_flags()
    printed = capsys.readouterr().out
    assert f"wrote {out} (1 of 2 runs)" in printed and f"wrote {out} (2 of 2 runs)" in printed
    written = json.loads(out.read_text())
    assert written["config"]["model"]["num_layers"] == 1 and written["batch"] == 8
    assert list(written["modes"]) == modes
    for mode, record in written["modes"].items():
        assert record["samples_per_s"] > 0 and len(record["iteration_s"]) == 2 and len(record["splits"]) == 2
        assert record["flops_per_sample"]["total"] > 0 and record["mfu"] > 0
        groups = {"shared"} if mode == "colocated" else {"rollout", "train"}
        assert set(record["bubble_frac"]) == groups and set(record["dispatch_frac"]) == groups
        assert all(0.0 <= f for f in record["dispatch_frac"].values())
        assert groups <= set(record["costs"]["rollout"]) and record["costs"]["train"] > 0
        events = read_trace(os.path.join(os.path.splitext(path)[0] + "_traces", record["trace"]))
        assert {"rollout", "train", "update"} <= {e["args"]["kind"] for e in events}
    assert set(simulator.predict_from_profile(written)) == set(modes)  # the record is a simulator profile


def test_system_mode_runs_diffusionnft(tmp_path, capsys):
    """configs/qwenimage_nft.py:tiny in the best mode: the record names the algorithm, carries
    DiffusionNFT's loss figures instead of GRPO's ratio figures, and its FLOPs per sample are
    NFT's (CFG-free rollout, K = 3 levels a sample); the default file name says nft."""
    from digen_jax.app import families
    from digen_jax.app.bench import system
    from digen_jax.app.run_sizing import sample_flops
    from digen_jax.runtime import simulator

    out = tmp_path / "nft.json"
    config_file = _tiny_qwenimage_config(
        tmp_path / "nft_config.py",
        "    c.runtime.rollout_devices, c.runtime.micro_batches = 4, 2  # the other 4 train\n"
        "    c.rl.prompts_per_iteration, c.rl.grad_chunk_size = 4, 12  # 2 prompts x 2 samples x 3 levels\n",
        module="qwenimage_nft",
    )
    parse(
        "--mode=system", f"--config={config_file}", "--modes=gap+tsp+tag+tcss", "--iterations=1",
        "--warmup_iterations=0", f"--workdir={tmp_path / 'work'}", f"--out={out}",
    )
    result, _ = bench.run_from_flags()
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["config"]["rl"]["algorithm"] == "nft"
    record = written["modes"]["gap+tsp+tag+tcss"]
    assert record["algorithm"] == "nft" and record["samples_per_s"] > 0
    assert not {"clip_frac", "lag0_units", "logp_diff_max", "ratio_mean"} & set(record)
    assert 0 < record["nft_rho_mean"] < 1 and record["nft_old_deviation"] >= 0 and record["nft_ref_penalty"] >= 0
    assert f"nft rho {record['nft_rho_mean']:.3f}" in printed
    from configs import qwenimage_nft

    config = qwenimage_nft.get_config("tiny")
    config.model.num_layers = 1
    model_cfg = families.model_config(config)
    assert model_cfg.num_layers == 1 and record["flops_per_sample"] == sample_flops(config, model_cfg)
    terms = model_flops.model_terms("qwenimage", model_cfg, batch=1, height=32, width=32, text_len=config.data.text_len)
    assert record["flops_per_sample"]["rollout"] == 4 * terms.forward().total  # no CFG batch
    assert set(simulator.predict_from_profile(written)) == {"gap+tsp+tag+tcss"}

    name = bench.default_out(dict(result, created_utc="2026-01-01T00:00:00+00:00"))
    assert os.path.basename(name).startswith("system_qwenimage_tiny_nft_")
    with pytest.raises(ValueError, match="play no part"):
        system.run_modes(config, ["gap"], str(tmp_path / "anchors"), onpolicy_anchors=["trainer"])


def test_system_mode_compares_onpolicy_anchors_in_one_run(tmp_path, monkeypatch):
    """`--onpolicy_anchors=rollout,trainer`: each mode once per anchor from the same weights, with the
    ratio figures of the timed iterations; anchored on the trainer's pass the lag-0 log-ratio is 0.
    The run's host copy of the initial state is dropped once the last of them has placed it."""
    runs, build = [], loop.Run
    monkeypatch.setattr(loop, "Run", lambda *a, **k: runs.append(build(*a, **k)) or runs[-1])
    out = tmp_path / "anchors.json"
    config_file = _tiny_qwenimage_config(tmp_path / "anchors_config.py")
    parse(
        "--mode=system", f"--config={config_file}", "--modes=colocated", "--onpolicy_anchors=rollout,trainer",
        "--iterations=1", "--warmup_iterations=0", f"--workdir={tmp_path / 'work'}", f"--out={out}",
    )
    bench.run_from_flags()
    records = json.loads(out.read_text())["modes"]
    assert list(records) == ["colocated onpolicy_anchor=rollout", "colocated onpolicy_anchor=trainer"]
    rollout, trainer = records.values()
    for record in (rollout, trainer):
        assert record["samples_per_s"] > 0 and record["lag0_units"] > 0
        assert record["rollout_logp_gap_max"] is not None and record["rollout_logp_gap_max"] < 1e-5
    assert rollout["onpolicy_anchor"] == "rollout" and rollout["logp_diff_max"] == rollout["rollout_logp_gap_max"]
    assert trainer["onpolicy_anchor"] == "trainer" and trainer["logp_diff_max"] == 0
    assert trainer["ratio_mean"] == 1 and trainer["clip_frac"] == 0
    assert len(runs) == 1 and runs[0].state is None


def test_profile_sums_device_time_by_kernel(tmp_path):
    """`--profile`'s summary on a trace shaped like a GPU one: device kernels counted once (not the
    XLA summary lines), host events left out, kernels put in their classes."""
    import gzip

    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
    ]
    kernels = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3000.0), ("memcpy128", 500.0),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 700.0), ("loop_add_fusion", 250.0),
               ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1000.0)]
    events = meta + [{"ph": "X", "pid": 1, "tid": 7, "ts": i, "dur": d, "name": n} for i, (n, d) in enumerate(kernels)]
    events += [{"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 9999.0, "name": "fusion.1"},
               {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 9999.0, "name": "PjitFunction(f)"}]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profiler.device_time_by_kernel(str(tmp_path))
    assert summary["device_ms"] == pytest.approx(5.45)
    assert summary["class_ms"] == pytest.approx({"matmul": 4.0, "attention": 0.7, "copy": 0.5, "fusion/other": 0.25})
    assert summary["kernels"][0]["calls"] == 2 and summary["kernels"][0]["class"] == "matmul"
    assert "error" in profiler.device_time_by_kernel(str(tmp_path / "none"))


def test_xla_flag_defaults_keep_what_the_user_set():
    from digen_jax import xla_flags

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_flags.set_defaults(env).split() == [
        "--xla_force_host_platform_device_count=8", *(f"--{k}={v}" for k, v in xla_flags.GPU_DEFAULTS.items())]
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert xla_flags.set_defaults(env) == "--xla_gpu_enable_triton_gemm=true"
    assert xla_flags.set_defaults({}) == xla_flags.set_defaults({"XLA_FLAGS": ""})


def test_launchers_give_jax_the_memory_share_the_plan_assumes_unless_the_user_set_one():
    from digen_jax import xla_flags
    from digen_jax.runtime.task_costs import Efficiency

    xla_flags.set_defaults(env := {})
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == xla_flags.MEM_FRACTION
    assert float(xla_flags.MEM_FRACTION) > Efficiency().usable_hbm  # headroom above what the plan admits
    xla_flags.set_defaults(env := {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    xla_flags.set_defaults(env := {}, memory=False)  # the tests' own process: flags only
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and env["XLA_FLAGS"]


def test_source_digest_names_the_code(tmp_path):
    for top in ("digen_jax", "launch", "configs"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("not code")
    before = provenance.source_digest(str(tmp_path))
    (tmp_path / "README.md").write_text("still not code")
    assert provenance.source_digest(str(tmp_path)) == before
    (tmp_path / "configs" / "a.py").write_text("x = 2\n")
    assert provenance.source_digest(str(tmp_path)) != before


def test_elastic_warm_up_runs_until_the_split_settles():
    """One extra warm-up always; then more while the next split differs from the last (its extra
    prefetch would finish inside the timed iteration) or the next iteration is the first to train
    prefetched samples, at most MAX_SETTLING_ITERATIONS."""
    from types import SimpleNamespace

    from digen_jax.app.bench import system

    class Executor:
        def __init__(self, split):
            self.split = split

        def split_for(self, k):
            return self.split

    last = [SimpleNamespace(tag=0, prefetch=3)] * 2
    first_prefetch = [SimpleNamespace(tag=1, prefetch=0), SimpleNamespace(tag=0, prefetch=3)]
    assert system._keep_warming(Executor((0, 3)), 2, first_prefetch, extra=1)
    assert not system._keep_warming(Executor((1, 0)), 2, first_prefetch[:1], extra=1)
    assert system._keep_warming(Executor((0, 3)), 1, last, extra=0)
    assert not system._keep_warming(Executor((0, 3)), 2, last, extra=1)
    assert system._keep_warming(Executor((0, 2)), 2, last, extra=1)
    assert system._keep_warming(Executor((1, 3)), 2, last, extra=2)
    assert not system._keep_warming(Executor((0, 2)), 4, last, extra=system.MAX_SETTLING_ITERATIONS)


def test_fp8_linear_forms_bench(tmp_path, monkeypatch):
    """benchmarks/fp8_linear.py at a tiny shape: every form runs and the FP8 ones stay within
    e4m3's error of the bf16 layer."""
    spec = importlib.util.spec_from_file_location("fp8_linear", os.path.join(ROOT, "benchmarks", "fp8_linear.py"))
    fp8_linear = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp8_linear)
    out = tmp_path / "fp8_linear.json"
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--shape=32,64,48", "--repeats=1", f"--out={out}"])
    fp8_linear.main()
    forms = json.loads(out.read_text())["forms"]
    assert set(forms) == set(fp8_linear.FORMS)
    for name, entry in forms.items():
        assert entry["median_ms"] > 0
        if name != "bf16" and "rel_err_vs_bf16" in entry:
            assert 1e-3 < entry["rel_err_vs_bf16"] < 0.1, (name, entry)


def test_model_mode_seq_parallel_splits_the_tokens_with_per_device_rates(tmp_path):
    """`--seq_parallel=2` (a video family): every measurement runs on 2 devices with the tokens
    split (Ulysses all-to-alls in the program); FLOPs count the whole program, rates are per device."""
    written = {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}.json"
        parse("--family=wan", "--frames=5", "--height=32", "--width=32", "--what=forward,lora_fwd_bwd",
              "--matmul_size=0", f"--seq_parallel={size}", f"--out={out}")
        bench.run_from_flags()
        written[size] = json.loads(out.read_text())
    one, two = written[1], written[2]
    assert two["config"]["seq_parallel"] == 2 and two["device"]["used"] == 2
    for what in ("forward", "lora_fwd_bwd"):
        a, b = one["results"][what], two["results"][what]
        assert "error" not in b, b.get("error")
        assert a["flops"] == b["flops"]  # the whole program's count
        assert b["flops_per_s"] == pytest.approx(b["flops"] / 2 / b["median_s"])  # per device
        assert b["memory_bytes"]["temp"] > 0 and b["all_to_all_ops"] > 0 and "all_to_all_ops" not in a
    # The GPU prints its all-to-alls in the async form; each start counts once, ragged ones not.
    gpu = ("%all-to-all-start = ((bf16[2,8]), bf16[2,8]) all-to-all-start(bf16[2,8] %x), dimensions={1}\n"
           "%all-to-all-done = bf16[2,8] all-to-all-done(%all-to-all-start)\n"
           "%all-to-all.1 = bf16[2,8] all-to-all(bf16[2,8] %y), dimensions={0}\n"
           "%r = bf16[4] ragged-all-to-all(bf16[4] %z, s32[2] %o)\n")
    assert model.all_to_all_ops(gpu) == 2
    with pytest.raises(ValueError, match="video families"):
        model.setup(model.ModelBench(**{**_bench_fields(), "family": "flux", "seq_parallel": 2}))


def _bench_fields():
    parse("--family=wan")
    return bench._model_bench().__dict__
