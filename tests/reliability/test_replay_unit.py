"""The replay check (sdc_check_every; reliability/replay.py, docs/sdc.md) without processes: a step computed again
leaves the run bit for bit as it was (random state, BatchNorm's statistics, the gradients); a transient fault in
either computation is found, judged by a third and the step goes on with right gradients; a step that does not
repeat is refused; and through ddp_kit.init, the check runs at its steps only, says what it found once and tells
the ledger, whose line the health gate counts against the host."""
from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_kit.preflight.leave import twice_failed
from ddp_kit.reliability.replay import FIRST, NONE, SAME, SECOND, THIRD, Computed, Finding, _digest, checked, judge

torch.manual_seed(0)
DATA = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))


def _model() -> nn.Module:
    torch.manual_seed(1)  # dropout (the random state) and BatchNorm (buffers): what a second computation could move
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))


def _flip_once(param: nn.Parameter, on_call: int):
    """A transient fault: the `on_call`-th gradient autograd delivers for `param` comes out doubled at one element."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        if calls[0] != on_call:
            return None
        out = grad.clone()
        out.view(-1)[int(out.abs().argmax())] *= 2
        return out
    return param.register_hook(hook)


def _step(model, x, y, *, check: bool, agree=None, exchange=None, fault=None, accumulated: int = 0):
    """One SGD-less step's gradients: `accumulated` micro-batches first (plain), then the last one, checked or not."""
    def compute():
        return nn.functional.cross_entropy(model(x), y)

    def backward(loss):
        loss.backward()

    for _ in range(accumulated):
        backward(compute())
    handle = fault(model) if fault else None
    try:
        if not check:
            loss = compute()
            backward(loss)
            return loss, None
        return checked([model], compute, backward, step=7, device=torch.device("cpu"), local=nullcontext,
                       agree=agree or (lambda same: same), exchange=exchange or (lambda mine: [mine]), host="here")
    finally:
        if handle is not None:
            handle.remove()


def _state(model):
    return ([p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()], torch.get_rng_state())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1] + [a[2]], b[0] + b[1] + [b[2]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_digest_moves_with_any_one_flipped_bit_and_not_with_the_summation_order(dtype):
    """Where a float sum rounds a low bit away (a large total), the bit patterns' integer sum still moves; and it
    is exact, so summing in another order (a kernel's other split) gives the same digest."""
    g = (torch.randn(100_000, dtype=torch.float64) * 1e4).to(dtype)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[dtype]
    width = torch.iinfo(bits).bits
    base = _digest(g)
    for bit in (0, 1, width // 2, width - 2, width - 1):
        hit = g.clone()
        word = hit.view(bits)
        word[4321] ^= torch.tensor(1, dtype=bits) << bit if bit < width - 1 else torch.tensor(torch.iinfo(bits).min, dtype=bits)
        assert not torch.equal(_digest(hit), base), (dtype, bit)
    assert torch.equal(_digest(g.flip(0)), base) and torch.equal(_digest(g.view(100, 1000).t()), base)


@pytest.mark.parametrize("accumulated", [0, 2])
def test_a_checked_step_leaves_rng_buffers_and_gradients_as_an_unchecked_one(accumulated):
    x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]
    plain = _model()
    torch.manual_seed(5)
    loss_plain, _ = _step(plain, x, y, check=False, accumulated=accumulated)
    after_plain = _state(plain)
    checked_model = _model()
    torch.manual_seed(5)
    loss_checked, found = _step(checked_model, x, y, check=True, accumulated=accumulated)
    assert found is None  # the two computations agreed
    assert torch.equal(loss_plain, loss_checked)
    assert _same(after_plain, _state(checked_model))  # dropout's draws, BatchNorm's statistics, the gradients


@pytest.mark.parametrize("on_call,odd", [(1, FIRST), (2, SECOND)])
@pytest.mark.parametrize("accumulated", [0, 2])
def test_a_transient_fault_in_either_computation_is_found_and_the_step_goes_on_right(on_call, odd, accumulated):
    x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]
    clean = _model()
    torch.manual_seed(5)
    _step(clean, x, y, check=False, accumulated=accumulated)
    model = _model()
    torch.manual_seed(5)
    held = []  # the accumulated gradients' tensors (DDP's bucket views where it made them): kept, not replaced
    loss, found = _step(model, x, y, check=True, accumulated=accumulated,
                        fault=lambda m: (held.extend(p.grad for p in m.parameters()), _flip_once(m[0].weight, on_call))[1])
    assert found is not None and found.odd == (odd,) and found.goes_on and found.ranks == (0,)
    assert found.what == ("its gradients",)  # the loss is the forward's: the fault came after it
    assert _same(_state(clean), _state(model))  # the third computation's gradients, the faultless ones
    if accumulated:
        assert all(p.grad is g for p, g in zip(model.parameters(), held))
    line = found.line()
    assert line.startswith("silent data corruption suspected at step 7 (replay check, sdc_check_every): rank 0 "
                           "(host here) computed its gradients differently in the "), line
    assert found.record()["hosts"] == ["here"] and found.record()["went_on"] is True


def test_the_odd_one_out_of_three():
    def c(loss, *grads):
        return Computed(torch.tensor(float(loss)), torch.tensor([[g, g] for g in grads], dtype=torch.int64))
    a, b, other = c(1, 1, 2), c(1, 1, 2), c(1, 1, 3)
    assert (judge(a, b, a), judge(other, a, b), judge(a, other, b), judge(a, b, other)) == (SAME, FIRST, SECOND, THIRD)
    assert judge(a, other, c(2, 1, 2)) == NONE
    nan = c(float("nan"), 1)
    assert judge(nan, nan, nan) == SAME  # a NaN the same computation gave is the same (the NaN guard says the rest)


def test_a_step_that_does_not_repeat_is_named_a_setting_alone_and_a_host_where_another_rank_repeats_it():
    model = _model()
    noise = torch.Generator().manual_seed(0)  # a loss drawing from a generator of its own: not replayed
    x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]

    def compute():
        return nn.functional.cross_entropy(model(x), y) + torch.rand((), generator=noise)

    _, found = checked([model], compute, lambda loss: loss.backward(), step=3, device=torch.device("cpu"),
                       local=nullcontext, agree=lambda same: same, exchange=lambda mine: [mine], host="here")
    assert found is not None and found.odd == (NONE,) and not found.goes_on and not found.a_host_to_blame
    assert found.not_repeatable().startswith("step 3 is not repeatable (replay check, sdc_check_every): computed "
                                             "three times, it gave other gradients on this rank")
    # a rank that repeated the step twice of three (a transient fault of its own) shows the step is repeatable
    assert Finding(3, (FIRST, NONE), ("its gradients", "its gradients"), ("a", "b")).a_host_to_blame
    one_bad = Finding(3, (SAME, NONE, THIRD), ("", "its loss", "its gradients"), ("a", "b", "c"))
    assert one_bad.a_host_to_blame and one_bad.bad == (1, 2)
    assert one_bad.not_repeatable() == ("silent data corruption suspected at step 3 (replay check, sdc_check_every): "
                                        "rank 1 (host b) computed the step with no two of three computations agreeing; "
                                        "rank 2 (host c) computed the step the same way twice, then differently")


def test_two_ranks_words_make_one_finding():
    """`agree` (an all-reduce of a flag) says that some rank differed; every rank computes the third time, and
    only then are the words gathered (`exchange`): the finding names rank 1 alone."""
    model = _model()
    x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]
    calls = []

    def exchange(mine):
        calls.append(mine)
        return [(SAME, "", "a"), mine]  # rank 0: its computations agreed

    _, found = _step(model, x, y, check=True, exchange=exchange, fault=lambda m: _flip_once(m[0].weight, 1))
    assert calls == [(FIRST, "its gradients", "here")]  # gathered once, after the third computation
    assert found.ranks == (1,) and found.hosts == ("a", "here") and "rank 1 (host here)" in found.line()
    _, nothing = _step(_model(), x, y, check=True, exchange=exchange)
    assert nothing is None and len(calls) == 1  # every rank agreed: nothing gathered


def _run(tmp_path, monkeypatch, every: int, fault_step: int | None, steps: int = 6):
    import ddp_kit
    from ddp_kit.env import DistEnv

    run = ddp_kit.init(run_dir=str(tmp_path), env=DistEnv(), device="cpu", resume="never", log_every=2,
                       sdc_check_every=every, hang_timeout_s=0, config={"case": "replay"})
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, loader, opt = run.prepare(model, DataLoader(DATA, batch_size=8, shuffle=True), opt)
    computed = []
    with run:
        run.resume(optimizer=opt)
        for x, y in loader:
            handle = _flip_once(run.unwrap(model)[0].weight, 1) if run.steps_done + 1 == fault_step else None

            def compute(x=x, y=y):
                computed.append(run.steps_done + 1)
                return nn.functional.cross_entropy(model(x), y)
            loss = run.forward_backward(model, compute)
            if handle is not None:
                handle.remove()
            opt.step()
            opt.zero_grad()
            if run.step(loss) >= steps:
                break
        weights = {k: v.clone() for k, v in run.unwrap(model).state_dict().items()}
    return weights, computed


def test_through_init_the_check_runs_at_its_steps_says_once_and_tells_the_ledger(tmp_path, monkeypatch, capsys):
    clean, computed = _run(tmp_path / "clean", monkeypatch, every=0, fault_step=None)
    assert computed == [1, 2, 3, 4, 5, 6]  # off: one computation a step
    unchecked, _ = _run(tmp_path / "unchecked", monkeypatch, every=0, fault_step=4)
    assert any(not torch.equal(clean[k], unchecked[k]) for k in clean)  # unchecked, the fault stays in the weights
    capsys.readouterr()
    weights, computed = _run(tmp_path / "checked", monkeypatch, every=2, fault_step=4)
    assert computed == [1, 2, 2, 3, 4, 4, 4, 5, 6, 6]  # every 2nd step twice; step 4 (the fault) three times
    assert all(torch.equal(clean[k], weights[k]) for k in clean)  # as if no fault had happened
    out = capsys.readouterr()
    said = [ln for ln in (out.out + out.err).splitlines() if "replay check" in ln]
    assert len(said) == 1 and said[0].startswith("ddp_kit: silent data corruption suspected at step 4 (replay check"), said
    records = [json.loads(ln) for ln in (tmp_path / "checked" / "attempts.jsonl").read_text().splitlines()]
    (line,) = [r for r in records if r["event"] == "replay"]
    assert (line["step"], line["ranks"], line["odd"], line["went_on"]) == (4, [0], {"0": "first"}, True)
    assert twice_failed(records + [{**line, "attempt": 2}], [line["hosts"][0]])  # twice: the gate leaves the host out


def test_sdc_check_every_refuses_a_negative_value():
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.errors import UserError

    with pytest.raises(UserError, match="sdc_check_every must be a whole number >= 0"):
        Policy(sdc_check_every=-1)


def test_through_init_a_step_that_does_not_repeat_ends_the_run_in_one_line_without_a_ledger_line(tmp_path, capsys):
    import ddp_kit
    from ddp_kit.env import DistEnv

    run = ddp_kit.init(run_dir=str(tmp_path), env=DistEnv(), device="cpu", resume="never", sdc_check_every=2,
                       hang_timeout_s=0, config={"case": "replay"})
    model = run.prepare(_model())
    noise = torch.Generator().manual_seed(0)
    x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]
    with pytest.raises(SystemExit) as ended, run:
        for _ in range(3):
            loss = run.forward_backward(model, lambda: nn.functional.cross_entropy(model(x), y)
                                        + torch.rand((), generator=noise))
            run.step(loss)
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if "not repeatable" in ln]
    assert ended.value.code == 2 and len(lines) == 1 and "step 2 is not repeatable" in lines[0], out.err[-2000:]
    assert "deterministic=True" in lines[0]
    records = [json.loads(ln) for ln in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["event"] == "replay"]  # the end line alone records it


def test_the_strategies_it_cannot_serve_are_refused_at_prepare():
    from ddp_kit.boundary.replay_check import refuse_strategy
    from ddp_kit.errors import UserError
    from ddp_kit.parallel.strategy import strategy

    refuse_strategy(0, strategy("fsdp"))  # off: anything goes
    refuse_strategy(10, strategy("ddp"))
    for name in ("fsdp", "hsdp"):
        with pytest.raises(UserError, match=f"strategy {name} shards the parameters"):
            refuse_strategy(10, strategy(name))


def test_sync_batchnorm_is_refused_where_it_shares_statistics():
    from ddp_kit.boundary.replay_check import refuse_sync_bn
    from ddp_kit.errors import UserError

    synced = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    refuse_sync_bn(0, [synced], 2)  # off
    refuse_sync_bn(10, [synced], 1)  # one rank: nothing shared
    refuse_sync_bn(10, [_model()], 2)  # plain BatchNorm: each rank's own
    with pytest.raises(UserError, match="SyncBatchNorm shares the batch statistics"):
        refuse_sync_bn(10, [_model(), synced], 2)


def test_a_loss_that_reaches_another_prepared_model_is_replayed_on_both(tmp_path):
    """An encoder and a head prepared together, the check named with the head: the encoder's gradients and
    BatchNorm statistics are the replay's too (else its gradient came out doubled on a check step)."""
    import ddp_kit
    from ddp_kit.env import DistEnv

    def trained(every: int):
        run = ddp_kit.init(run_dir=str(tmp_path / str(every)), env=DistEnv(), device="cpu", resume="never",
                           sdc_check_every=every, hang_timeout_s=0, config={"case": "replay2"})
        torch.manual_seed(1)
        enc, head = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3)
        enc, head = run.prepare(enc, head)
        x, y = DATA.tensors[0][:16], DATA.tensors[1][:16]
        with run:
            for _ in range(2):
                loss = run.forward_backward(head, lambda: nn.functional.cross_entropy(head(enc(x)), y))
                grads = [p.grad.clone() for p in [*enc.parameters(), *head.parameters()]]
                for p in [*enc.parameters(), *head.parameters()]:
                    p.grad = None
                run.step(loss)
        return grads, [b.clone() for b in enc.buffers()]

    plain, checked_ = trained(0), trained(1)
    assert all(torch.equal(a, b) for a, b in zip(plain[0] + plain[1], checked_[0] + checked_[1]))
