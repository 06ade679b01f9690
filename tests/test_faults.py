"""Faults: nothing silent, nothing left behind (on cpu ranks).

The launcher: a signal reaches every rank (and what it started), nothing runs and no heap file exists
afterwards; a rank that leaves early, or dies while the world is being made, has the others stopped and is
named; the store listens on 127.0.0.1 only. The runtime: a bad WEFT_* value names the variable, a second
init with other sizes raises, ranks asking for different sizes are told so on every rank, a wait timeout
is caught by its own type, check_errors raises what a family registered.
"""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

from weft.testing import run_ranks
from weft.testing.ranks import RankFailure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = {"WEFT_EXIT_GRACE_S": "2", "WEFT_KILL_GRACE_S": "2"}


def weft_run(*args, n=2):
    env = dict(os.environ, **GRACE, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "weft", "run", "-n", str(n), *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def heap_files() -> set:
    return set(glob.glob("/dev/shm/weft-*"))


def wait_for(paths, seconds=60):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.1)


# Each rank: weft.init (a heap exists), starts a child that sleeps, records both pids and its heap mapping.
SLEEPER = """
import os, subprocess, sys, time
import weft
weft.init()
child = subprocess.Popen(["sleep", "600"])
maps = [line.split()[-2] for line in open("/proc/self/maps") if "weft-heap" in line]
out = sys.argv[1]
with open(f"{out}/rank{weft.rank()}.tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid} {' '.join(sorted(set(maps)))}")
os.rename(f"{out}/rank{weft.rank()}.tmp", f"{out}/rank{weft.rank()}")
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_every_rank_and_nothing_is_left(tmp_path, sig):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    before = heap_files()
    launcher = weft_run(script, tmp_path)
    wait_for([tmp_path / "rank0", tmp_path / "rank1"])
    records = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    pids = [int(p) for rec in records for p in rec[:2]]
    assert all(alive(p) for p in pids)
    assert all(rec[2:] == ["/memfd:weft-heap"] for rec in records), records  # no named file to leave behind
    t0 = time.monotonic()
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig, err
    assert f"got {signal.Signals(sig).name}; passed on to every rank" in err
    assert time.monotonic() - t0 < 15
    assert not [p for p in pids if alive(p)], "a rank or its child outlived the launcher"
    assert not heap_files() - before


def test_a_rank_leaving_early_has_the_others_stopped(tmp_path):
    """Rank 1 exits 0 without finalize while rank 0 waits (here: sleeps) for it: the launcher does not hang."""
    script = tmp_path / "leaves.py"
    script.write_text("import os, sys, time\nimport weft\nweft.init()\n"
                      "open(f'{sys.argv[1]}/pid{weft.rank()}', 'w').write(str(os.getpid()))\n"
                      "if weft.rank() == 1:\n    sys.exit(0)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    launcher = weft_run(script, tmp_path)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, err
    assert "rank 1 left first (exit code 0) and rank 0 did not follow within 2 s" in err, err
    assert time.monotonic() - t0 < 60
    assert not alive(int((tmp_path / "pid0").read_text()))


def test_a_rank_dying_in_init_has_the_others_stopped(tmp_path):
    """Rank 1 is killed (SIGKILL: no clean-up of its own) once its process group exists, while the world is
    still being made (the size check, the heap, the first barrier) or just after: the launcher names it,
    stops rank 0, and no heap file remains."""
    script = tmp_path / "dies.py"
    script.write_text("import os, signal, sys, threading, time\nimport torch.distributed as dist\nimport weft\n"
                      "open(f'{sys.argv[1]}/pid{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\n"
                      "def die():\n    while not dist.is_initialized():\n        time.sleep(0.001)\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "if os.environ['RANK'] == '1':\n    threading.Thread(target=die, daemon=True).start()\n"
                      "weft.init()\nweft.barrier()\ntime.sleep(600)\n")
    before = heap_files()
    launcher = weft_run(script, tmp_path)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "weft run: rank 1 was killed by SIGKILL; the other ranks were stopped" in err, err
    assert not alive(int((tmp_path / "pid0").read_text()))
    assert not heap_files() - before


def test_the_store_listens_on_loopback_only(tmp_path):
    """The launcher's store: listening on 127.0.0.1 at MASTER_PORT, on no other address (IPv4 or IPv6)."""
    script = tmp_path / "listen.py"
    script.write_text("import os\nport = ':%04X' % int(os.environ['MASTER_PORT'])\n"
                      "for table in ('tcp', 'tcp6'):\n"
                      "    for line in open(f'/proc/net/{table}').read().splitlines()[1:]:\n"
                      "        local, state = line.split()[1], line.split()[3]\n"
                      "        if state == '0A' and local.endswith(port):\n"
                      "            print(table, local.split(':')[0], os.environ['MASTER_ADDR'])\n")
    launcher = weft_run(script, n=1)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert out.split("\n")[:-1] == ["tcp 0100007F 127.0.0.1"], out  # 127.0.0.1, little-endian hex


# -- settings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, accepted", [
    ("WEFT_BACKEND", "gpu", "cpu or cuda"),
    ("WEFT_HEAP_SIZE", "lots", "a positive number of bytes"),
    ("WEFT_HEAP_SIZE", "-4MiB", "a positive number of bytes"),
    ("WEFT_WORKSPACE_BYTES", "4 MB", "a positive number of bytes"),
    ("WEFT_WORKSPACE_BYTES", "0", "a positive number of bytes"),
    ("WEFT_INIT_TIMEOUT_S", "forever", "seconds > 0"),
    ("WEFT_WAIT_TIMEOUT_S", "5s", "seconds > 0"),
    ("WEFT_WAIT_TIMEOUT_S", "nan", "seconds > 0"),
    ("WEFT_EXIT_GRACE_S", "inf", "seconds > 0"),
    ("WEFT_KILL_GRACE_S", "-2", "seconds > 0"),
    ("WEFT_TEST_DELAY", "1:2:100", "RANKS:PROBABILITY:MAX_US"),
    ("WEFT_TEST_DELAY", "odd:0.5:100", "RANKS:PROBABILITY:MAX_US"),
])
def test_a_bad_setting_is_named_with_its_value_and_range(monkeypatch, name, value, accepted):
    import weft
    from weft.runtime import settings

    monkeypatch.setenv(name, value)
    expected = f"{name}={value!r}: expected {accepted}"
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        settings.get(name)
    assert not weft.is_initialized()
    with pytest.raises(ValueError, match=name):  # init reads every one before it starts anything
        weft.init()
    assert not weft.is_initialized()


@pytest.mark.parametrize("value", ["-1", "0"])
def test_a_wait_timeout_that_is_not_positive_is_refused(value):
    """WEFT_WAIT_TIMEOUT_S=-1 (or 0) once disabled the timeout silently: now no rank starts."""
    with pytest.raises(RankFailure, match=f"WEFT_WAIT_TIMEOUT_S='{value}': expected seconds > 0"):
        run_ranks(lambda: None, 1, timeout=60, env={"WEFT_WAIT_TIMEOUT_S": value})


# -- init ------------------------------------------------------------------------------------------------

def _init_twice():
    import weft

    w = weft.world()
    assert weft.init() is w and weft.init(heap_size=w.heap.size, workspace_bytes=w.workspace_bytes) is w
    messages = []
    for kwargs in (dict(heap_size=w.heap.size * 2), dict(workspace_bytes=w.workspace_bytes + 256)):
        with pytest.raises(ValueError) as e:
            weft.init(**kwargs)
        messages.append(str(e.value))
    assert weft.world() is w
    return messages


def test_init_again_with_other_sizes_raises():
    heap = 64 << 20
    messages = run_ranks(_init_twice, 1, timeout=60)[0]
    assert messages == [
        f"weft.init(heap_size={2 * heap}): weft is already initialised with heap_size={heap}; call "
        "weft.finalize() first to start a world of another size",
        f"weft.init(workspace_bytes={(4 << 20) + 256}): weft is already initialised with workspace_bytes={4 << 20}; "
        "call weft.finalize() first to start a world of another size"]


def _sizes_differ():
    import weft

    rank = weft.rank()
    weft.finalize()
    try:
        weft.init(heap_size=(rank + 1) << 20)
    except ValueError as e:
        message = str(e)
    else:
        message = None
    assert not weft.is_initialized()
    weft.init()  # the failed init left nothing behind: a corrected one works
    return message


def test_ranks_asking_for_different_heap_sizes_are_told_on_every_rank():
    messages = run_ranks(_sizes_differ, 2, timeout=120)
    assert messages == ["weft.init: heap_size differs across ranks (rank 0: 1048576, rank 1: 2097152); every rank "
                        "must pass the same value (WEFT_HEAP_SIZE / WEFT_WORKSPACE_BYTES or weft.init's arguments; "
                        "WEFT_LOCAL_WORLD_SIZE / LOCAL_WORLD_SIZE for the ranks per node)"] * 2


# -- errors ----------------------------------------------------------------------------------------------

def _caught_by_type():
    import torch

    import primitive_kernels
    import weft

    flag = weft.zeros((1,), torch.int32)
    weft.barrier()
    try:
        primitive_kernels.never_signalled_kernel[(1,)](flag, weft.world().heap.descriptor)
    except weft.WaitTimeout as e:
        return type(e).__name__, isinstance(e, RuntimeError), str(e)
    return None


def test_a_wait_timeout_is_caught_by_its_own_type():
    results = run_ranks(_caught_by_type, 2, timeout=60, env={"WEFT_WAIT_TIMEOUT_S": "0.5"})
    assert results[0] is None  # rank 0 waits for nothing
    name, is_runtime_error, message = results[1]
    assert name == "WaitTimeout" and is_runtime_error
    assert message.startswith("weft wait: rank 1 timed out after 0.5 s waiting for the signal of rank 0 (flag 0 of 1"), \
        message
    assert message.endswith("expected flag == 1, seen 0")


def _stuck_in_rank_one():
    import time

    import weft

    if weft.rank() == 1:
        time.sleep(600)  # a hang: run_ranks' timeout ends it
    return True


def test_a_timed_out_run_shows_where_its_ranks_hang(capfd):
    with pytest.raises(RankFailure, match=r"timed out after 20 s; ranks still running: \[(0, )?1\] \(each wrote its "
                                          r"threads' Python stacks to stderr\)"):
        run_ranks(_stuck_in_rank_one, 2, timeout=20)  # room for the ranks to start on a busy machine
    stacks = capfd.readouterr().err
    rank_one = stacks[stacks.index("--- rank 1 "):]
    assert "in _stuck_in_rank_one" in rank_one.split("--- rank")[1], stacks[-3000:]


def _registered_checks():
    import weft

    calls = []
    weft.check_errors()  # nothing registered, nothing pending
    weft.world().error_checks.append(lambda: calls.append("first"))

    def bad_row():
        raise ValueError(f"topk_idx row 3 on rank {weft.rank()}")

    weft.world().error_checks.append(bad_row)
    with pytest.raises(ValueError, match=f"topk_idx row 3 on rank {weft.rank()}"):
        weft.check_errors()
    return calls


def test_check_errors_runs_every_registered_check():
    assert run_ranks(_registered_checks, 2, timeout=60) == [["first"], ["first"]]


def _moe_error_word_reaches_check_errors():
    """A bad topk_idx row an MoE kernel recorded (on GPUs it is raised at the family's next call) is what
    check_errors raises: the family's error word registers itself when it is made."""
    import torch

    import weft

    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3]])
    weft.ops.ep_dispatch_ll(x, idx, 4, 4)  # makes the EP workspace and its error word
    word = next(c.__self__ for c in weft.world().error_checks if hasattr(c, "__self__"))
    word.host[0] = (1 << 62) | (2 << 33) | 1  # as check_rows records row 2 naming expert 1 twice
    with pytest.raises(ValueError, match="topk_idx row 2 names expert 1 twice"):
        weft.check_errors()
    weft.check_errors()  # raised once, then cleared


def test_check_errors_raises_a_recorded_routing_error():
    run_ranks(_moe_error_word_reaches_check_errors, 1, timeout=120)
