"""run.py / `vembed train` (vembed/entrypoints/launch.py): a one-process launch trains in the launcher itself, as
accelerate's launcher would have run it; and under faults: bad accelerate configs are one line before any process
starts, a second launch into a running run's folder is refused, a killed launcher takes its ranks with it, and when
one rank fails its own error is the line the user sees, naming the rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vembed.entrypoints import launch
from vembed.training.run_dir import RunLock

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _recipe_file(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


ACCELERATE_CONFIGS = {  # file text, what the one line says
    "invalid YAML": ("distributed_type: [MULTI_GPU\n", "is not valid YAML at line 2"),
    "binary": (b"\x80\x81\xfe\xff" * 64, "is not a text file"),
    "the recipe itself": (None, "is not an accelerate config (no distributed_type)"),
    "negative process count": ("distributed_type: MULTI_CPU\nnum_processes: -2\n", "-2 in"),
    "unknown distributed_type": ("distributed_type: BOGUS\nnum_processes: 1\n", "distributed_type: 'BOGUS'"),
    "unknown mixed_precision": ("distributed_type: 'NO'\nmixed_precision: maybe\n", "mixed_precision: 'maybe'"),
    "bare NO": ("distributed_type: NO\n", "quote it: distributed_type: 'NO'"),
}


@pytest.mark.parametrize("case", list(ACCELERATE_CONFIGS))
def test_a_bad_accelerate_config_is_one_line_before_any_process_starts(tiny_clip_recipe, tmp_path, capsys, case):
    text, says = ACCELERATE_CONFIGS[case]
    recipe = _recipe_file(tmp_path, tiny_clip_recipe)
    config = recipe if text is None else tmp_path / "accelerate.yaml"
    if text is not None:
        config.write_bytes(text if isinstance(text, bytes) else text.encode())
    code = launch.main([str(recipe), "--accelerate_config", str(config)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("launch error: ") and says in err and "\n" not in err, err
    assert not Path(tiny_clip_recipe["output_dir"]).exists()


def test_a_second_launch_into_a_running_runs_folder_is_refused(tiny_clip_recipe, tmp_path, capsys):
    out = Path(tiny_clip_recipe["output_dir"])
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from vembed.training.run_dir import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = launch.main([str(_recipe_file(tmp_path, tiny_clip_recipe)), "--accelerate_config", "single"])
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"in use by another vembed run (pid {holder.pid} " in err and "\n" not in err


@pytest.mark.parametrize("config, processes", [("deepspeed_zero2", 1), ("ddp_cpu", 2), ("single", 2)])
def test_configs_derived_for_a_launch_are_removed_when_it_ends(tiny_clip_recipe, tmp_path, monkeypatch, capsys,
                                                                config, processes):
    """DeepSpeed (its JSON made absolute) and multi-CPU (its DDP launcher) launches left a tmp*-NAME.yaml in $TMPDIR
    per launch."""
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    monkeypatch.setattr(launch, "_check_launcher_installed", lambda config: None)  # deepspeed need not be installed
    seen = []

    def launched(launch_args, num_processes=None):
        config_file = Path(launch_args[launch_args.index("--config_file") + 1])
        seen.append((config_file, config_file.is_file()))
        assert os.environ[launch.EXPECTED_WORLD_SIZE_ENV] == str(processes)  # the ranks inherit the promise
        return 0

    monkeypatch.setattr(launch, "launch_in_process", launched)
    before = dict(os.environ)
    recipe = _recipe_file(tmp_path, tiny_clip_recipe)
    assert launch.main([str(recipe), "--accelerate_config", config, "--num_processes", str(processes)]) == 0
    # the promise was for the ranks: the caller's environment is given back (a second launch from the same Python
    # process, as in a notebook or the next test, read the first one's promise)
    assert dict(os.environ) == before
    [(config_file, existed)] = seen
    derived = config_file.parent != launch.CONFIGS  # single, 2 processes: rewritten for the DDP launcher
    assert existed and (derived or config == "ddp_cpu") and list(scratch.iterdir()) == []
    assert launch.main([str(recipe), "--accelerate_config", config, "--num_processes", str(processes),
                        "--dry_run"]) == 0
    if derived:  # a dry run prints a command naming the derived file: that one stays, and says where
        assert "stays in" in capsys.readouterr().err and len(list(scratch.iterdir())) == 1


@pytest.mark.parametrize("config, processes, in_launcher", [
    ("single", 1, True), ("ddp_cpu", 2, False), ("ddp_cpu", 1, False), ("deepspeed_zero2", 1, False),
    ("fsdp", 1, False),
])
def test_only_a_launch_of_one_plain_process_trains_in_the_launcher(config, processes, in_launcher):
    args = ["--config_file", str(launch.CONFIGS / f"{config}.yaml"), "--num_processes", str(processes), "train.py"]
    env = launch.one_plain_process_env(args)
    assert (env is not None) == in_launcher
    if in_launcher:  # accelerate's simple launcher's variables, e.g. one OpenMP thread unless OMP_NUM_THREADS is set
        assert env["ACCELERATE_MIXED_PRECISION"] == "no" and env["ACCELERATE_USE_CPU"] == "False"
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")


# In the launcher's process (`vembed train`, which runs run.py's launch): accelerate's simple launcher (which starts a
# second interpreter) must not run.
NO_SECOND_PROCESS = ("import sys, accelerate.commands.launch as launcher; "
                     "launcher.simple_launcher = lambda args: sys.exit('a second interpreter was started'); "
                     "from vembed.cli import main; sys.exit(main(['train', *sys.argv[1:]]))")


@pytest.mark.slow
def test_a_one_process_launch_trains_in_the_launcher_as_accelerate_launch_would(tiny_clip_recipe, tmp_path):
    """run.py / `vembed train` with a one-process config train in their own process (no second interpreter importing
    torch and transformers again), and the run is the one `accelerate launch` gives: same plan, same weights, same
    metrics. Its threads follow the cores: accelerate's one-process launcher says OMP_NUM_THREADS=1 when the user set
    nothing, and `vembed train` used to train on that one thread (0.50x sentence-transformers' samples/s on 2 cores).
    (One test, not two: each run here is a fresh interpreter's worth of imports.)"""
    import torch
    from launching import final_weights

    from vembed.training.threads import available_cores

    raw = dict(tiny_clip_recipe, max_steps=3, save_steps=None, eval_before_training=True)
    env = {key: value for key, value in ENV.items() if key != "OMP_NUM_THREADS"}  # accelerate's default: 1 thread
    runs = {}
    for name, command in (
        ("in the launcher", [sys.executable, "-c", NO_SECOND_PROCESS, "--accelerate_config", "single"]),
        ("accelerate launch", [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(launch.CONFIGS / "single.yaml"), "vembed/entrypoints/train.py"]),
    ):
        out = tmp_path / name.replace(" ", "_")
        recipe = _recipe_file(tmp_path, dict(raw, output_dir=str(out)))
        result = subprocess.run([*command, str(recipe)], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (result.stdout + result.stderr, final_weights(out), json.loads((out / "metrics.json").read_text()))
    (log, weights, metrics), (reference_log, reference_weights, reference_metrics) = runs.values()
    assert "(in this process)" in log
    start_block = [line for line in reference_log.splitlines()
                   if line.startswith(("strategy ", "device ", "threads ", "precision "))]
    assert len(start_block) == 4 and all(line in log for line in start_block), log
    cores = available_cores()
    threads = next(line for line in start_block if line.startswith("threads "))
    assert threads.split()[1:4] == [str(cores), "intra-op", "per"], threads
    assert f"({cores} core{'s' if cores != 1 else ''} / 1 process on this machine)" in threads, threads
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[key], reference_weights[key]) for key in weights)
    for split in ("before", "validation", "test"):
        assert metrics[split] == reference_metrics[split], split


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has stopped; only its parent's wait is missing


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("config", ["single", "ddp_cpu"])
def test_killing_the_launcher_stops_its_training_process(tiny_clip_recipe, tmp_path, config):
    """SIGKILL to run.py alone used to leave its rank training (own session) and writing final/ 8-15 s later. A
    one-process launch now trains in the launcher itself (no child), so the kill stops it outright."""
    raw = dict(tiny_clip_recipe, max_steps=100000, save_steps=None, logging_steps=1000,
               data={"train": tiny_clip_recipe["data"]["train"]})
    out = Path(raw["output_dir"])
    launcher = subprocess.Popen([sys.executable, "run.py", str(_recipe_file(tmp_path, raw)), "--accelerate_config",
                                 config], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.json").is_file():  # written by the rank just before its first step
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ranks = _children(launcher.pid)
        if config == "single":
            assert ranks == [], "a one-process launch started a training process instead of training in the launcher"
        else:
            assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "the training process outlived its launcher"
        RunLock(out).acquire().release()  # and the launcher's lock died with it: a relaunch is let in
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (out / "final").exists()


RANK_FAILS = """
import sys
import torch.distributed as dist
from vembed.entrypoints import run_cli
from vembed.errors import DataError

def body():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise DataError("cannot read as json: line 2 is not valid JSON", file="shard-1.jsonl", row=2)
    dist.all_reduce(__import__("torch").ones(1))  # rank 0 waits here: its peer is gone
    return 0

sys.exit(run_cli(body, debug=False))
"""


@pytest.mark.slow
def test_when_one_rank_fails_its_own_error_is_the_line_shown_naming_the_rank(tmp_path):
    """Rank 1's error used to be lost (only rank 0 prints) under rank 0's gloo traceback and 'its error is above'."""
    script = tmp_path / "rank_fails.py"
    script.write_text(RANK_FAILS)
    code = ("import sys; from vembed.entrypoints.launch import launch_in_process; "
            "sys.exit(launch_in_process(sys.argv[1:], 2))")
    config = ROOT / "vembed" / "accelerate_configs" / "ddp_cpu.yaml"
    env = dict(ENV, VEMBED_LAUNCHER_PID="1")  # what run.py sets: ranks hand their errors to it
    result = subprocess.run([sys.executable, "-c", code, "--config_file", str(config), "--num_processes", "2",
                             "--main_process_port", str(launch._free_port()), str(script)],
                            env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert lines == ["data error: shard-1.jsonl, row 2: cannot read as json: line 2 is not valid JSON "
                     "[rank 1 of 2 failed first; the other ranks were stopped]"], result.stderr
    assert not json.dumps(result.stderr).count("Traceback")


def test_a_process_that_is_its_own_launcher_does_not_die_with_itself():
    """The launcher's pid in the environment of the launcher itself (it trains or evaluates in-process, or a promise
    was left behind) must not make stop_with_launcher end it: it did, with os._exit(1), taking a test run along."""
    code = ("import os; from vembed.training.launch_promise import LAUNCHER_PID_ENV, stop_with_launcher; "
            "os.environ[LAUNCHER_PID_ENV] = str(os.getpid()); print(stop_with_launcher())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


# --- refusals before work: each bad input is one line, exit 2, and nothing written --------------------------------

TEXT_BERT = {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
             "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32}
# xlm names its blocks `attentions.0.`, `ffns.0.`: no parameter name says its layer as depths.py reads them
TEXT_XLM = {"model_type": "xlm", "vocab_size": 512, "emb_dim": 32, "n_layers": 1, "n_heads": 4,
            "max_position_embeddings": 32}


def _text_recipe(tmp_path: Path, tokenizer_dir: str, **changes) -> dict:
    rows = [{"query": f"question {i} about shape {i % 5}", "positive": f"answer {i}: a shape {i % 5}"}
            for i in range(16)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    return {"model_type": "text", "tokenizer_name": tokenizer_dir, "model_config": TEXT_BERT,
            "data": {"train": str(data)}, "output_dir": str(tmp_path / "run"), "batch_size": 8, "seed": 0,
            "max_steps": 2, "eval_before_training": False, **changes}


def _refused(recipe: dict, tmp_path: Path, capsys) -> list[str]:
    """run.py on `recipe`: exit 2 and no output folder; the lines it printed."""
    code = launch.main([str(_recipe_file(tmp_path, recipe))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert not Path(recipe["output_dir"]).exists()
    return lines


@pytest.mark.parametrize("case, says", [
    ("layer_lr_decay on a model whose parameter names say no layer",
     "recipe error: layer_lr_decay: no parameter name of model_type 'text' says which layer it is in"),
    ("document_pool_factor without scipy", "environment error: document_pool_factor: token pooling needs scipy"),
])
def test_a_recipe_the_model_or_the_installation_cannot_train_is_one_line_before_the_launch(
        tmp_path, capsys, monkeypatch, mask_tokenizer_dir, case, says):
    if case.startswith("layer_lr_decay"):
        recipe = _text_recipe(tmp_path, mask_tokenizer_dir, model_config=TEXT_XLM, layer_lr_decay=0.7)
    else:  # a ColBERT whose corpus evaluation (and every later search) pools documents' token vectors
        monkeypatch.setitem(sys.modules, "scipy.cluster.hierarchy", None)  # import fails as when scipy is missing
        recipe = _text_recipe(tmp_path, mask_tokenizer_dir, embedding="multi_vector", multi_vector_dim=16,
                              query_length=12, loss_type="late_interaction", document_pool_factor=2)
    lines = _refused(recipe, tmp_path, capsys)
    assert len(lines) == 1 and lines[0].startswith(says), lines  # not even the launch line: no process was started


def test_a_loss_that_mines_on_labels_is_refused_data_without_them_before_the_run_folder_is_taken(
        tmp_path, capsys, mask_tokenizer_dir):
    recipe = _text_recipe(tmp_path, mask_tokenizer_dir, loss_type="batch_hard_triplet")
    lines = _refused(recipe, tmp_path, capsys)
    assert lines[-1] == (f"data error: {tmp_path / 'pairs.jsonl'}, row 1: loss_type batch_hard_triplet mines on "
                         "labels, but 16 of 16 training records have none in data.columns.label ('label'); give "
                         "every row a label, or map data.columns.label to the column that holds them"), lines
    assert all(line.startswith("launching ") for line in lines[:-1]), lines


@pytest.mark.parametrize("split", ["validation", "test"])
def test_an_image_of_a_held_out_split_that_does_not_decode_stops_the_launch_before_the_run_folder_is_taken(
        tiny_clip_recipe, dummy_data_dir, tmp_path, capsys, split):
    import shutil

    data = tmp_path / "data"  # a copy: the session's dummy data stays whole
    shutil.copytree(dummy_data_dir, data)
    first = json.loads((data / f"{split}.jsonl").read_text().splitlines()[0])
    broken = data / (first.get("positive_image") or first["query_image"])
    broken.write_bytes(b"not an image")  # training never reads it: only evaluation would, after final/ was written
    recipe = {**tiny_clip_recipe, "max_steps": 2,
              "data": {**{name: str(data / f"{name}.jsonl") for name in ("train", "validation", "test")},
                       "image_root": str(data)}}
    recipe["data"]["train"] = str(tmp_path / "train.jsonl")  # the training rows without the broken image
    rows = [row for row in (data / "train.jsonl").read_text().splitlines() if broken.name not in row]
    Path(recipe["data"]["train"]).write_text("\n".join(rows) + "\n")
    lines = _refused(recipe, tmp_path, capsys)
    assert lines[-1].startswith(f"data error: {broken}: cannot decode image: UnidentifiedImageError") and (
        f"images of data.{split} do not decode, and evaluation reads every one" in lines[-1]), lines
    assert all(line.startswith("launching ") for line in lines[:-1]), lines


@pytest.mark.parametrize("changes, flags, says", [
    ({"mixed_precision": "fp16"}, ["--accelerate_config", "single"],
     "recipe error: mixed_precision: fp16 needs a GPU; use bf16 or no on CPU"),
    ({"use_fsdp": True}, ["--accelerate_config", "ddp_cpu", "--num_processes", "2"],
     "recipe error: use_fsdp: is true but this launch is not FSDP"),
    ({"use_gradient_cache": True}, ["--accelerate_config", "fsdp"],
     "recipe error: use_gradient_cache: GradCache is not available under FSDP"),
], ids=["fp16-on-cpu", "use_fsdp-under-ddp", "gradcache-under-fsdp"])
def test_what_the_recipe_asks_of_the_launch_is_judged_before_any_process_starts(tiny_clip_recipe, tmp_path, capsys,
                                                                                 changes, flags, says):
    import torch

    if "mixed_precision" in changes and torch.cuda.is_available():
        pytest.skip("fp16 is refused on CPU only")
    code = launch.main([str(_recipe_file(tmp_path, {**tiny_clip_recipe, **changes})), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(says), lines  # not one line per rank, no launch line
    assert not Path(tiny_clip_recipe["output_dir"]).exists()


def test_the_failing_ranks_own_exit_code_stands_when_the_agent_killed_it_after_it_reported():
    """Under load, torch's agent can SIGTERM the rank that failed first (once the other rank has exited) after it
    handed its error over but before its exit code 2 reached the agent: the exit code is the one it handed over."""
    from types import SimpleNamespace

    from vembed.entrypoints.launch import _root_failure

    first = SimpleNamespace(exitcode=-15, timestamp=2, error_file_data={"vembed": {
        "line": "data error: broken.jsonl, row 2: not JSON", "time": 10.0, "peer_lost": False, "exit_code": 2}})
    later = SimpleNamespace(exitcode=2, timestamp=1, error_file_data={"vembed": {
        "line": "data error: broken.jsonl, row 2: not JSON", "time": 11.0, "peer_lost": False, "exit_code": 2}})
    assert _root_failure({0: later, 1: first}) == (1, first, "data error: broken.jsonl, row 2: not JSON", 2)
    silent = SimpleNamespace(exitcode=-9, timestamp=1, error_file_data=None)
    assert _root_failure({0: silent}) == (0, silent, None, None)  # nothing handed over: the agent's code decides
