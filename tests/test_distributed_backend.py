"""`--distributed-backend {nccl,gloo}` (Megatron-LM's flag) and gloo on CUDA tensors (issue 31).

On the CPU: the flag parses with Megatron-LM's choices and follows the device when left out; nccl off CUDA is one
line before any process group (tests/test_launcher.py runs it: exit 2); the launcher's device choice, with
torch's CUDA queries stubbed, gives each rank its own GPU under nccl and shares the GPUs under gloo. What gloo
cannot carry on CUDA tensors (point-to-point) is staged through host memory: `comm.stages` is checked against
the table (engine/parallel/comm.py, docs/guide.md), and on two gloo ranks the staged send and receive, called
directly on CPU tensors, deliver bitwise what the unstaged ones do, for every pairing of the two.

On a GPU (`pytest -m gpu`): every collective of comm.py on CUDA tensors under gloo equals, bitwise, the same
collective on CPU tensors (two ranks sharing the GPU), and two gloo ranks on the one GPU train one step (two
iterations) at tp 2 + SP, pp 2, cp 2, ep 2 and ZeRO-3 with the losses and gradient norm of one rank.
"""
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from engine.cli import parse_config
from engine.config import ConfigError
from engine.parallel import comm
from engine.run.device import device_and_backend, gpu_index

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device: gloo on CUDA tensors needs a GPU")
# comm.py's function for each operation of the table
FUNCTION = {"all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather_into",
            "reduce_scatter": "reduce_scatter_into", "all_to_all": "all_to_all_single", "send": "send_op",
            "recv": "recv_op"}


def test_the_flag_takes_megatrons_choices_and_is_unset_by_default():
    assert parse_config(["--mock-data"]).parallel.distributed_backend is None
    for name in ("nccl", "gloo"):
        assert parse_config(["--mock-data", "--distributed-backend", name]).parallel.distributed_backend == name
    with pytest.raises(ConfigError, match="--distributed-backend: invalid choice: 'mpi'"):
        parse_config(["--mock-data", "--distributed-backend", "mpi"])


@pytest.mark.parametrize("device, backend, cuda, want", [
    ("auto", None, True, ("cuda", "nccl")), ("auto", None, False, ("cpu", "gloo")),
    ("cuda", None, True, ("cuda", "nccl")), ("cpu", None, True, ("cpu", "gloo")),
    ("auto", "gloo", True, ("cuda", "gloo")), ("cuda", "gloo", True, ("cuda", "gloo")),
    ("cpu", "gloo", False, ("cpu", "gloo")), ("auto", "nccl", True, ("cuda", "nccl")),
])
def test_the_backend_follows_the_device_unless_named(device, backend, cuda, want):
    assert device_and_backend(device, backend, cuda) == want


@pytest.mark.parametrize("device, cuda, where", [("cpu", True, "(--device cpu)"),
                                                 ("auto", False, "(no CUDA device is visible)")])
def test_nccl_on_the_cpu_is_one_line(device, cuda, where):
    with pytest.raises(ConfigError) as info:
        device_and_backend(device, "nccl", cuda)
    assert str(info.value) == (f"--distributed-backend nccl: NCCL runs on CUDA devices only and this run is on the "
                               f"CPU {where}; use --distributed-backend gloo, or leave the flag out")


def test_gloo_ranks_share_the_gpus_and_nccl_ranks_need_one_each():
    assert [gpu_index("gloo", r, 4, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [gpu_index("gloo", r, 4, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [gpu_index("nccl", r, 8, 8) for r in range(8)] == list(range(8))
    with pytest.raises(ConfigError, match="nccl: 4 ranks on this node but 1 visible GPU"):
        gpu_index("nccl", 0, 4, 1)


def _launcher():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, "launch", "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launcher_puts_gloo_ranks_on_one_gpu_and_refuses_nccl_there(monkeypatch):
    """torch's CUDA queries stubbed as on a one-GPU machine with 4 local ranks, this one LOCAL_RANK 3."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    pick = _launcher()._pick_device
    assert pick(parse_config(["--mock-data", "--distributed-backend", "gloo"]), 4) == ("cuda:0", "gloo")
    with pytest.raises(ConfigError, match="nccl: 4 ranks on this node but 1 visible GPU"):
        pick(parse_config(["--mock-data"]), 4)
    assert pick(parse_config(["--mock-data", "--device", "cpu"]), 4) == ("cpu", "gloo")
    assert chosen == [0]


def test_only_point_to_point_stages_and_only_gloo_on_cuda():
    staged = {op for op in comm.GLOO_CARRIES_CUDA if comm.stages("gloo", "cuda", op)}
    assert staged == {"send", "recv"}  # ProcessGroupGloo: send/recv take the data pointer as host memory
    assert set(comm.GLOO_CARRIES_CUDA) == set(FUNCTION)
    for op in comm.GLOO_CARRIES_CUDA:
        assert not any(comm.stages(backend, device, op) for backend in ("nccl", "gloo", None) for device in
                       ("cpu", "cuda") if (backend, device) != ("gloo", "cuda"))


def test_the_guide_and_comm_state_the_same_table():
    readme = open(os.path.join(ROOT, "docs", "guide.md")).read().splitlines()
    for op, carried in comm.GLOO_CARRIES_CUDA.items():
        rows = [line for line in readme if line.startswith("|") and f"`{FUNCTION[op]}`" in line]
        assert len(rows) == 1, (op, rows)
        assert ("staged" in rows[0]) == (not carried), rows[0]
        assert f"{FUNCTION[op]}" in comm.__doc__


# ---------------------------------------------------------------- staged point-to-point, on two gloo ranks
def _payloads(rank: int) -> list:
    """Random bit patterns (NaNs with payloads, infinities, -0.0, subnormals), in several dtypes and layouts."""
    g = torch.Generator().manual_seed(100 + rank)
    bits32 = torch.randint(-2 ** 31, 2 ** 31, (6, 5), generator=g, dtype=torch.int64).to(torch.int32)
    bits16 = torch.randint(-2 ** 15, 2 ** 15, (3, 4, 2), generator=g, dtype=torch.int64).to(torch.int16)
    return [bits32.view(torch.float32), bits16.view(torch.bfloat16), bits32.to(torch.int64),
            bits32.view(torch.float32).t(),  # not contiguous
            torch.randint(0, 2, (9,), generator=g).bool()]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _exchange(rank, world):
    """Both ranks send every payload to the other in one batch, in the four pairings of staged and plain."""
    peer, mine, theirs = 1 - rank, _payloads(rank), _payloads(1 - rank)
    assert type(comm.recv_op(torch.empty(3), peer)) is dist.P2POp  # CPU tensors under gloo: nothing staged
    volumes = []
    for send, recv in [(comm.send_op, comm.recv_op), (comm.host_send_op, comm.recv_op),
                       (comm.send_op, comm.host_recv_op), (comm.host_send_op, comm.host_recv_op)]:
        into = [torch.full(t.shape, 7, dtype=t.dtype) for t in theirs]
        with comm.counting() as counter:
            works = comm.batch_isend_irecv([send(t, peer) for t in mine] + [recv(t, peer) for t in into])
        for work in works:
            work.wait()
        for got, want in zip(into, theirs):
            assert torch.equal(_bytes(got), _bytes(want)), (send.__name__, recv.__name__, got.dtype)
        volumes.append([(r.op, r.payload, r.sent) for r in counter.records])
    assert all(v == volumes[0] for v in volumes), volumes


def test_staged_send_and_receive_deliver_bitwise_what_the_plain_ones_do():
    run_ranks(_exchange, 2, timeout=120)


# ---------------------------------------------------------------- on a GPU: gloo ranks sharing it
def _collectives(device: str, rank: int) -> dict:
    """Every operation of comm.py once, on tensors of `device`, the results brought to the CPU."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(8, 6, generator=g).to(device)
    out = {"all_reduce": x.clone(), "all_reduce_max": x.clone(), "broadcast": x.clone(),
           "all_gather": x.new_empty(16, 6), "reduce_scatter": x.new_empty(4, 6),
           "all_to_all": x.new_empty(6 + 4 * rank, 6), "p2p": x.new_empty(8, 6)}
    comm.all_reduce(out["all_reduce"])
    comm.all_reduce(out["all_reduce_max"], op=comm.ReduceOp.MAX)
    comm.broadcast(out["broadcast"], src=1)
    comm.all_gather_into(out["all_gather"], x)
    comm.reduce_scatter_into(out["reduce_scatter"], x)
    rows = 3 + 2 * rank  # uneven: rank 0 takes 3 rows from each rank, rank 1 takes 5
    comm.all_to_all_single(out["all_to_all"], x, [rows, rows], [3, 5])
    for work in comm.batch_isend_irecv([comm.send_op(x, 1 - rank), comm.recv_op(out["p2p"], 1 - rank)]):
        work.wait()
    return {k: v.cpu() for k, v in out.items()}


def _cuda_equals_cpu(rank, world):
    torch.cuda.set_device(0)
    assert isinstance(comm.recv_op(torch.empty(3, device="cuda"), 1 - rank), comm._HostRecv)
    on_cpu, on_cuda = _collectives("cpu", rank), _collectives("cuda", rank)
    return {k: torch.equal(_bytes(on_cpu[k]), _bytes(on_cuda[k])) for k in on_cpu}


@pytest.mark.gpu
@needs_cuda
def test_every_collective_on_cuda_under_gloo_equals_the_cpu_one_bitwise():
    for rank, same in enumerate(run_ranks(_cuda_equals_cpu, 2, timeout=180)):
        assert all(same.values()), (rank, same)


STEP = ["--mock-data", "--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr-warmup-iters", "0", "--log-interval", "1", "--device", "cuda"]
DENSE, MOE = ["--config", "configs/gpt-tiny.yaml"] + STEP, ["--config", "configs/moe-tiny.yaml"] + STEP
LAYOUTS = {"tp2+sp": (DENSE, ["--tp", "2", "--sequence-parallel"]), "pp2": (DENSE, ["--pp", "2"]),
           "cp2": (DENSE, ["--cp", "2"]), "ep2": (MOE, ["--ep", "2"]),
           "zero3": (DENSE, ["--data-parallel-sharding-strategy", "optim_grads_params"])}


def _train(args: list, nproc: int, metrics: str) -> dict:
    from test_trainer import last_train_records, launch, read_records
    code, output, _ = launch(args + ["--metrics-file", metrics], nproc, timeout=300)
    assert code == 0, output[-6000:]
    return last_train_records(read_records(metrics))


_ONE_RANK = {}  # model arguments -> the one-rank run's records: each model's reference is trained once


def _one_rank(model: list, folder) -> dict:
    key = tuple(model)
    if key not in _ONE_RANK:
        _ONE_RANK[key] = _train(model, 1, str(folder / "one.jsonl"))
    return _ONE_RANK[key]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_two_gloo_ranks_on_one_gpu_train_as_one_rank(name, tmp_path):
    model, layout = LAYOUTS[name]
    one = _one_rank(model, tmp_path)
    two = _train(model + layout + ["--distributed-backend", "gloo"], 2, str(tmp_path / "two.jsonl"))
    assert sorted(two) == sorted(one) == [1, 2]
    for it in (1, 2):  # iteration 2's loss is after the first optimizer step
        assert abs(two[it]["lm_loss"] - one[it]["lm_loss"]) <= 1e-4, (name, it, two[it], one[it])
    assert two[1]["grad_norm"] == pytest.approx(one[1]["grad_norm"], rel=1e-4), (name, two[1], one[1])
