"""The intra-op thread rule (vembed/training/threads.py): the OMP_NUM_THREADS the user set wins; else the cores this
process may use over the processes launched beside it; the 1 a launcher puts in OMP_NUM_THREADS does not count."""

from __future__ import annotations

import pytest
import torch

from vembed.training import threads
from vembed.training.threads import USER_THREADS_ENV, choose_threads, local_processes, user_omp_num_threads


@pytest.mark.parametrize("cores, processes, user, expected", [
    (2, 1, None, 2), (2, 2, None, 1), (16, 4, None, 4), (1, 4, None, 1), (7, 2, None, 3),
    (2, 1, "3", 3), (16, 8, "1", 1), (2, 1, "0", 2), (2, 1, "lots", 2), (2, 1, "", 2),
])
def test_the_users_thread_count_wins_else_cores_are_shared_by_the_local_processes(cores, processes, user, expected):
    choice = choose_threads(cores, processes, user)
    assert choice.count == expected
    if user and user.isdigit() and int(user) > 0:
        assert choice.reason == f"OMP_NUM_THREADS={user}, set by the user"
    else:
        assert f"{cores} core" in choice.reason and f"/ {processes} process" in choice.reason
        assert ("not a positive number" in choice.reason) == (user not in (None, ""))


def test_local_processes_come_from_the_launchers_local_world_size():
    assert local_processes({}) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_processes({"LOCAL_WORLD_SIZE": "0"}) == 1


@pytest.fixture
def no_parent_launcher(monkeypatch):
    monkeypatch.setattr("vembed.training.launch_promise._parent_accelerate_launch_arguments", lambda: None)


def test_the_1_accelerates_one_process_launcher_injects_is_not_the_users(no_parent_launcher, monkeypatch):
    """run.py / `vembed train` start one process with the environment accelerate's simple launcher builds, which says
    OMP_NUM_THREADS=1 when the user set nothing; the user's own value travels beside it and decides."""
    from vembed.entrypoints import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = ["--config_file", str(launch.CONFIGS / "single.yaml"), "--num_processes", "1", "train.py"]
    env = launch.one_plain_process_env(args)
    assert env["OMP_NUM_THREADS"] == "1"  # accelerate's
    assert user_omp_num_threads({**env, USER_THREADS_ENV: ""}) is None
    assert choose_threads(2, local_processes(env), None).count == 2
    assert user_omp_num_threads({**env, USER_THREADS_ENV: "1"}) == "1"  # the user's own 1 is kept


def test_a_process_started_without_a_launcher_has_the_users_own_setting(no_parent_launcher):
    assert user_omp_num_threads({"OMP_NUM_THREADS": "1"}) == "1"
    assert user_omp_num_threads({}) is None


def test_under_accelerate_launch_or_torchrun_the_launchers_own_environment_says_what_the_user_set(monkeypatch,
                                                                                                  no_parent_launcher):
    launched = {"TORCHELASTIC_RUN_ID": "none", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    monkeypatch.setattr(threads, "_parent_environment", lambda: {"PATH": "/bin"})
    assert user_omp_num_threads(launched) is None
    monkeypatch.setattr(threads, "_parent_environment", lambda: {"OMP_NUM_THREADS": "1"})
    assert user_omp_num_threads(launched) == "1"
    monkeypatch.setattr(threads, "_parent_environment", lambda: None)  # unreadable (not Linux): taken as the user's
    assert user_omp_num_threads(launched) == "1"
    monkeypatch.setattr("vembed.training.launch_promise._parent_accelerate_launch_arguments", lambda: ["train.py"])
    monkeypatch.setattr(threads, "_parent_environment", lambda: {})
    assert user_omp_num_threads({"OMP_NUM_THREADS": "1"}) is None  # accelerate's simple launcher, one process


def test_the_parent_environment_is_read_from_proc():
    parent = threads._parent_environment()  # pytest's parent: a shell or a runner, started with some environment
    assert isinstance(parent, dict) and parent


def test_use_threads_sets_torchs_count(monkeypatch, no_parent_launcher):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    try:
        choice = threads.use_threads({"LOCAL_WORLD_SIZE": "3"})
        assert choice.count == 2 and torch.get_num_threads() == 2
        assert threads.use_threads({"OMP_NUM_THREADS": "1"}).count == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_available_cores_is_at_most_the_affinity():
    import os

    assert 1 <= threads.available_cores() <= len(os.sched_getaffinity(0))
