"""The user tools on the built-in tiny random video DiT (CPU, reference FP4 numerics)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import accuracy_report  # noqa: E402
import capture_attention  # noqa: E402
import generate_video  # noqa: E402
import replay_attention  # noqa: E402
import report  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("module", [generate_video, capture_attention, replay_attention, report])
def test_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_generate_video_help_and_usage_errors_import_neither_torch_nor_diffusers():
    """--help and a bad option answer from the torch-free argument module (nvfp4_dit.cli)."""
    import subprocess

    probe = ("import runpy, sys; sys.argv = ['generate_video.py'] + sys.argv[1:]\n"
             "try:\n    runpy.run_path(%r, run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "heavy = sorted(m for m in ('torch', 'diffusers') if m in sys.modules)\n"
             "print('HEAVY', heavy, 'CODE', code)") % str(SCRIPTS / "generate_video.py")
    for args, code in ((["--help"], 0), (["--keep-mass", "2"], 2)):
        res = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
        assert f"HEAVY [] CODE {code}" in res.stdout, (args, res.stdout[-500:], res.stderr[-1500:])


def test_generate_video_compare_writes_mp4_and_json(tmp_path):
    imageio = pytest.importorskip("imageio")
    pytest.importorskip("imageio_ffmpeg")
    out = tmp_path / "video.mp4"
    rc = generate_video.main(["--attention", "compare", "--steps", "4", "--dense-steps", "1,1", "--out", str(out),
                              "--device", "cpu"])
    assert rc == 0
    for path in (out, tmp_path / "video_sdpa.mp4"):
        reader = imageio.get_reader(str(path), "ffmpeg")
        frames = [f for f in reader]
        reader.close()
        assert len(frames) == 17 and frames[0].shape == (128, 128, 3)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["backend"] == "reference" and set(report["runs"]) == {"sdpa", "nvfp4"}
    run = report["runs"]["nvfp4"]
    assert [s["step"] for s in run["steps"]] == [0, 1, 2, 3]
    assert [s["dense_step"] for s in run["steps"]] == [True, False, False, True]
    # CFG: 2 forwards per step, 2 blocks x (self + cross) attention calls each.
    assert all(s["forwards"] == 2 and s["fp4_calls"] + s["exact_calls"] == 8 for s in run["steps"])
    assert [s["fp4_calls"] for s in run["steps"]] == [0, 4, 4, 0]  # self-attention FP4, cross dense
    assert all(0 < s["attention_share"] < 1 for s in run["steps"])
    assert run["sequence_lengths"]["transformer.blocks.0.attn1"] == {"q_len": 320, "k_len": 320, "heads": 2,
                                                                     "head_dim": 64}
    assert run["sequence_lengths"]["transformer.blocks.0.attn2"]["k_len"] == 32
    assert run["peak_memory"]["bytes"] > 0
    assert all(c["path"] == "exact" for c in report["runs"]["sdpa"]["attention_calls"])
    cmp = report["compare"]
    assert 0.99 < cmp["latent_cos"] < 1.0 and cmp["frames_psnr_db"] > 30


def test_capture_and_replay_reproduce_live_outputs(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "cap.safetensors"
    rc = capture_attention.main(["--attention", "nvfp4", "--steps", "3", "--dense-steps", "1,0",
                                 "--capture-layers", "transformer.blocks.1.*", "--capture-steps", "0,2",
                                 "--out", str(path), "--device", "cpu"])
    assert rc == 0
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == capture_attention.FORMAT
        assert len(list(f.keys())) == 4 * 8  # q, k, v, out of 8 calls (2 steps x 2 forwards x 2 layers)
    calls, _ = capture_attention.load_capture(path)
    assert {(c["step"], c["layer"]) for c in calls} == {
        (s, f"transformer.blocks.1.attn{i}") for s in (0, 2) for i in (1, 2)}
    paths = {(c["step"], c["layer"].rsplit(".", 1)[1]): c["path"] for c in calls}
    assert paths[(2, "attn1")] == "fp4" and paths[(0, "attn1")] == "exact" and paths[(2, "attn2")] == "exact"

    rows = replay_attention.replay(calls, ["sdpa", "reference"], torch.device("cpu"))
    assert rows and all(r["live_bit_exact"] for r in rows)
    assert all(r["rel_l2"] < 1e-5 for r in rows if r["backend"] == "sdpa")
    assert all(0 < r["rel_l2"] < 0.25 and r["cos"] > 0.99 for r in rows if r["backend"] == "reference")

    png, js = tmp_path / "replay.png", tmp_path / "replay.json"
    # --device cpu: the capture ran on the CPU; replayed on a GPU, SDPA's outputs differ in the last bits.
    assert replay_attention.main([str(path), "--backends", "sdpa,reference", "--device", "cpu", "--png", str(png),
                                  "--json", str(js)]) == 0
    assert png.stat().st_size > 0 and len(json.loads(js.read_text())) == len(rows)


def test_replay_detects_a_changed_output(tmp_path):
    """The bit-exact check can fail: perturb one captured output and the replay says so."""
    path = tmp_path / "cap.safetensors"
    assert capture_attention.main(["--steps", "2", "--capture-layers", "transformer.blocks.0.attn1",
                                   "--capture-steps", "1", "--max-calls", "1", "--out", str(path),
                                   "--device", "cpu"]) == 0
    calls, _ = capture_attention.load_capture(path)
    assert len(calls) == 1 and calls[0]["path"] == "exact"
    calls[0]["out"] = calls[0]["out"].clone()
    calls[0]["out"].view(-1)[0] += 1e-3
    rows = replay_attention.replay(calls, ["sdpa"], torch.device("cpu"))
    assert not rows[0]["live_bit_exact"]


def test_load_capture_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, str(p), metadata={"format": "other"})
    with pytest.raises(ValueError, match="not an nvfp4_dit attention capture"):
        capture_attention.load_capture(p)


def test_report_writes_markdown_with_figures(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    assert report.main(["--quick", "--out", str(out), "--device", "cpu", "--skip", "families,generation"]) == 0
    md = (out / "report.md").read_text()
    assert "## 1. Op accuracy" in md and "| RoPE Q/K |" in md
    assert "## 4. Calibrated per-layer policy" in md and "| calibrated | " in md and "| uniform | " in md
    assert "| transformer.blocks.1.attn1 | last |" in md
    assert "## 5. Block-sparse NVFP4" in md and "| transformer.blocks.0.attn1 | 1 | " in md
    assert "## 6. Per-layer replay" in md and "reproduced bit-exactly by the replay: yes" in md
    assert "Needs a CUDA GPU" in md or "## 7. Kernel benchmark" in md
    for png in ("accuracy.png", "replay.png"):
        assert f"({png})" in md and (out / png).stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--frames", "10"], "num_frames must be 4k + 1"),
    (["--height", "100"], "multiples of 16"),
    (["--frames", "0"], "argument --frames: must be at least 1"),
    (["--steps", "two"], "argument --steps: expected an integer"),
    (["--keep-mass", "1.5"], "argument --keep-mass: must be in (0, 1]"),
    (["--keep-mass", "most"], "argument --keep-mass: expected a number in (0, 1]"),
    (["--sparse-off-steps", "-1,0"], "steps must be >= 0"),
])
def test_generate_video_rejects_bad_arguments_before_running(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        generate_video.main([*args, "--no-video", "--device", "cpu"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_video_calibrates_then_reuses_the_policy(tmp_path, capsys):
    common = ["--steps", "4", "--no-video", "--device", "cpu"]
    assert generate_video.main([*common, "--calibrate", "--json", str(tmp_path / "cal.json")]) == 0
    out = capsys.readouterr().out
    assert "| transformer.blocks.0.attn1 | middle |" in out and "calibrated on WanTransformer3DModel" in out
    policy_file = tmp_path / "cal.policy.json"
    saved = json.loads(policy_file.read_text())
    report = json.loads((tmp_path / "cal.json").read_text())
    assert report["policy"] == saved and report["policy_file"] == str(policy_file)
    assert {(e["layer"], e["bucket"]) for e in saved["per_layer"]} == {
        (f"transformer.blocks.{i}.attn1", b) for i in (0, 1) for b in ("first", "middle", "last")}
    assert all({(e["qk_format"], e["balance_qk"]) for e in entry["errors"]}
               == {("nvfp4", False), ("nvfp4", True), ("mxfp8", True)} for entry in saved["per_layer"])
    assert generate_video.main([*common, "--policy", str(policy_file), "--json", str(tmp_path / "re.json")]) == 0
    again = json.loads((tmp_path / "re.json").read_text())
    assert again["policy"] == saved and again["runs"]["nvfp4"]["steps"][1]["fp4_calls"] == 4


@pytest.mark.parametrize("args, message", [
    (["--budget", "0.1"], "--budget needs --calibrate"),
    (["--calibrate", "--policy", "p.json"], "cannot also read one"),
    (["--policy", "p.json", "--min-seq-len", "4"], "drop --min-seq-len"),
    (["--policy", "missing.json"], "missing.json"),
])
def test_generate_video_policy_argument_errors(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        generate_video.main([*args, "--no-video", "--device", "cpu"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_generate_video_context_parallel_under_torchrun_on_cpu(tmp_path):
    """Two gloo ranks, Ulysses: the run is the single-process run bit for bit (per-head FP4)."""
    import subprocess

    common = ["--steps", "3", "--attention", "compare", "--no-video", "--device", "cpu"]
    assert generate_video.main([*common, "--json", str(tmp_path / "one.json")]) == 0
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "generate_video.py"), *common, "--context-parallel", "ulysses",
                          "--json", str(tmp_path / "cp.json")], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("metrics:") == 1  # rank 0 reports
    one, cp = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "cp"))
    assert cp["context_parallel"] == {"mode": "ulysses", "world_size": 2} and one["context_parallel"] is None
    calls = cp["runs"]["nvfp4"]["attention_calls"]
    assert {(c["q_len"], c["heads"]) for c in calls if c["path"] == "fp4"} == {(320, 1)}
    assert cp["compare"] == one["compare"]


def test_generate_video_context_parallel_needs_torchrun():
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node"):
        generate_video.main(["--context-parallel", "ring", "--no-video", "--device", "cpu"])


def test_generate_video_says_when_no_call_ran_nvfp4(tmp_path, capsys):
    assert generate_video.main(["--steps", "2", "--dense-steps", "0,0", "--min-seq-len", "100000", "--no-video",
                                "--device", "cpu", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "attention calls: 0 NVFP4" in out and "no call ran NVFP4" in out and "short sequence" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("script, args", [("bench_attention", []), ("bench_quantize", ["--smoke"]),
                                          ("bench_quantize", []), ("bench_launch", ["--profile", "5"]),
                                          ("bench_sparse", ["--estimate-ops"])])
def test_benchmarks_without_a_gpu_say_so(script, args):
    import subprocess

    res = subprocess.run([sys.executable, str(SCRIPTS / f"{script}.py"), *args], capture_output=True, text=True)
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.cuda
def test_bench_launch_measures_each_row_and_profiles():
    import json
    import subprocess

    res = subprocess.run([sys.executable, str(SCRIPTS / "bench_launch.py"), "--calls", "30", "--json", "--profile", "5"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["us_per_call"]
    assert len(rows) == 5 and all(us > 0 for us in rows.values())
    assert "tottime" in res.stderr



def test_figures_without_matplotlib_say_what_to_install(monkeypatch, tmp_path, capsys):
    import plotting

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if it were not installed
    with pytest.raises(SystemExit, match=r"--png needs matplotlib \(pip install matplotlib\)"):
        replay_attention.main([str(tmp_path / "capture.safetensors"), "--png", str(tmp_path / "replay.png")])
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plotting.pyplot()


def test_generate_video_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit):
        generate_video.main(["--dense-steps", "-1,1"])
    assert "steps must be >= 0" in capsys.readouterr().err
    for argv, words in ((["--model", "/no/such/folder"], "no such folder"),
                        (["--model", str(Path(__file__).parent)], "no model_index.json")):
        with pytest.raises(SystemExit, match=words):
            generate_video.main(argv + ["--no-video"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            generate_video.main(["--device", "cuda", "--no-video"])


def test_generate_video_runs_block_sparse_with_keep_mass(tmp_path, monkeypatch):
    from nvfp4_dit import ops

    seen = []
    real = ops.run_fp4
    monkeypatch.setattr(ops, "run_fp4", lambda *a, **kw: seen.append(kw.get("sparsity")) or real(*a, **kw))
    out = tmp_path / "r.json"
    assert generate_video.main(["--steps", "3", "--dense-steps", "0,0", "--keep-mass", "0.9", "--sparse-off-steps",
                                "1,0", "--sparse-min-seq-len", "0", "--no-video", "--device", "cpu",
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    policy = report["policy"]
    assert policy["keep_mass"] == 0.9 and policy["sparse_off_steps"] == [1, 0]
    per_step = len(seen) // 3
    assert all(s is None for s in seen[:per_step]) and all(s.keep_mass == 0.9 for s in seen[per_step:])
    # The JSON gives each block-sparse call's density, and per layer and step their mean.
    (run,) = report["runs"].values()
    sparse_calls = [c for c in run["attention_calls"] if c["keep_mass"] is not None]
    assert sparse_calls and all(0 < c["density"] <= 1 for c in sparse_calls)
    assert set(run["sparse_density"]) == {c["layer"] for c in sparse_calls}
    assert all(set(per) == {"1", "2"} for per in run["sparse_density"].values())   # JSON keys: steps 1, 2
    # The tiny Wan's self-attention runs in the 3D tiles of its latent grid; its cross-attention has none.
    grids = {tuple(c["video_grid"]) if c["video_grid"] else None for c in sparse_calls}
    assert None not in grids and len(grids) == 1
    assert all(c["video_grid"] is None for c in run["attention_calls"] if c["keep_mass"] is None)
    # The summary counts the sparse calls, their mean density, and the dense ones by their rule.
    summary = run["block_sparse"]
    assert summary["calls"] == len(sparse_calls)
    assert summary["mean_density"] == pytest.approx(sum(c["density"] for c in sparse_calls) / len(sparse_calls), abs=1e-4)
    assert summary["dense_calls"] == {"on sparse_off_steps 1,0": per_step}


def test_generate_video_keep_mass_on_the_tiny_model_runs_sparse_by_default(tmp_path, capsys):
    """--keep-mass alone runs the tiny model's self-attention block-sparse (its thresholds are the
    tiny model's), and the summary line says how many calls, at which density, and why the others
    ran dense."""
    out = tmp_path / "r.json"
    assert generate_video.main(["--steps", "4", "--keep-mass", "0.9", "--no-video", "--device", "cpu",
                                "--json", str(out)]) == 0
    text = capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"].values()
    summary = run["block_sparse"]
    # 4 steps: 0 and 3 exact (dense_steps 1,1), 1 dense NVFP4 (sparse_off_steps 2,0), 2 block-sparse;
    # CFG x 2 blocks = 4 self-attention calls per step
    assert summary["calls"] == 4 and summary["dense_calls"] == {"on sparse_off_steps 2,0": 4}
    assert f"block-sparse: 4 of the NVFP4 calls, mean density {summary['mean_density']:.3f}" in text
    assert "dense NVFP4: 4 on sparse_off_steps 2,0" in text
    if summary["mean_density"] >= 1.0:
        assert "the estimate kept every key tile" in text
    # below the tiny model's threshold, every call stays dense and the summary names the threshold
    assert generate_video.main(["--steps", "4", "--keep-mass", "0.9", "--sparse-min-seq-len", "1000", "--no-video",
                                "--device", "cpu", "--json", str(out)]) == 0
    assert "block-sparse: 0 of the NVFP4 calls; dense NVFP4: 8 shorter than sparse_min_seq_len 1000" in \
        capsys.readouterr().out


def test_accuracy_report_classes_of_many_q_blocks():
    """The report's classes of at least 64 Q blocks: random block means span (almost) every
    direction, the video's (a RoPE'd channel bias) a few; the 3D one runs in the op's tiles."""
    gen = torch.Generator().manual_seed(0)
    spread = {}
    for kind in (k for k in accuracy_report.KINDS if f"{accuracy_report.MANY_BLOCKS} blocks" in k):
        q, _, _ = accuracy_report.make_inputs(kind, 1, 2048, 2, 128, gen)
        assert q.shape[1] >= accuracy_report.MANY_BLOCKS * 128
        means = q[0, :accuracy_report.MANY_BLOCKS * 128].unflatten(0, (-1, 128)).mean(1)[:, 0].double()
        energy = torch.linalg.svdvals(means - means.mean(0)).pow(2)
        spread[kind] = float(energy[:16].sum() / energy.sum())   # the share 16 directions hold
        assert accuracy_report.class_video_grid(kind) == (accuracy_report.MANY_BLOCKS_GRID if "3D" in kind else None)
    assert spread["random block means x2 (64 blocks)"] < 0.6
    assert spread["video + channel bias (64 blocks)"] > 0.99
