"""The LK losses (arXiv 2602.23881) of common/training/loss.py: the fused soft-CE + acceptance function
against float64 references (values, gradients, chunking), p == q, ttt_loss's lk_alpha / lk_lambda against a
position-by-position loop, the kl path unchanged, and 04 training end to end with --loss."""
import contextlib
import importlib
import json
from types import SimpleNamespace

import pytest
import torch

from common.stage import TRAIN, stage_dir
from common.training import loss as loss_mod
from common.training.loss import (LK_ETA, soft_cross_entropy, soft_cross_entropy_acceptance, ttt_loss)
from common.training.teacher import step_counts
from tests.train_helpers import FLAGS, fresh_work, make_upstream, micro_batch

train = importlib.import_module(TRAIN)


@pytest.fixture(scope="module")
def upstream(micro_target, tmp_path_factory):
    return make_upstream(micro_target, tmp_path_factory.mktemp("work"))


def topk_like(p: torch.Tensor, k: int) -> torch.Tensor:
    """p kept on its k largest entries, renormalised: zero elsewhere, as teacher_from_topk's rows."""
    keep = torch.zeros_like(p).scatter_(1, p.topk(k, -1).indices, 1.0)
    return (p * keep) / (p * keep).sum(-1, keepdim=True)


def reference(logits, target_p, rows):
    """float64 (ce, alpha) by the definitions: -sum p log softmax, sum min(p, softmax)."""
    z, p = logits.double(), target_p[rows].double()
    q = torch.softmax(z, -1)
    return -(p * torch.log_softmax(z, -1)).sum(-1), torch.minimum(p, q).sum(-1)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows (Dv = 40): the chunk loops and the label views cross chunk borders."""
    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 3 * 40)


@pytest.mark.parametrize("rows", [[5, 0, 3, 3, 7, 1, 2], [1, 2, 3, 4, 5, 6, 7]])   # gather / contiguous view
def test_values_and_gradients_equal_float64_reference(rows, small_chunks):
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(8, 40) * 2, -1)
    p[::2] = topk_like(p[::2], 5)                                   # top-k rows: zero outside their top 5
    rows = torch.tensor(rows)
    logits = (torch.randn(len(rows), 40) * 2).requires_grad_()
    ce, alpha, arg = soft_cross_entropy_acceptance(logits, p, rows)
    ref_logits = logits.detach().double().requires_grad_()
    ce_ref, alpha_ref = reference(ref_logits, p, rows)
    assert ce.dtype == alpha.dtype == torch.float32 and torch.equal(arg, logits.argmax(-1))
    assert torch.allclose(ce.double(), ce_ref, atol=1e-5) and torch.allclose(alpha.double(), alpha_ref, atol=1e-6)
    assert bool((alpha > 0).all() and (alpha < 1).all())
    # the soft-CE output is the one _SoftCrossEntropy gives
    ce_kl, arg_kl = soft_cross_entropy(logits.detach(), p, rows)
    assert torch.allclose(ce, ce_kl, atol=1e-6) and torch.equal(arg, arg_kl)
    w_ce, w_a = torch.rand(len(rows), dtype=torch.float64), torch.randn(len(rows), dtype=torch.float64)
    for make in (lambda c, a: (c * w_ce.to(c.dtype)).sum() + (a * w_a.to(a.dtype)).sum(),   # both outputs
                 lambda c, a: (a * w_a.to(a.dtype)).sum(),                                  # alpha only
                 lambda c, a: -a.log().sum(),                                               # lk_alpha
                 lambda c, a: (c * w_ce.to(c.dtype)).sum()):                                # ce only
        g, = torch.autograd.grad(make(ce, alpha), logits, retain_graph=True)
        g_ref, = torch.autograd.grad(make(ce_ref, alpha_ref), ref_logits, retain_graph=True)
        assert torch.allclose(g.double(), g_ref, atol=1e-5), (g - g_ref).abs().max()


def test_gradcheck_float64(small_chunks):
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(6, 40, dtype=torch.float64) * 2, -1)
    p[1] = topk_like(p[1:2], 3)[0]
    rows = torch.tensor([4, 1, 1, 0, 5])
    logits = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, dtype=torch.float64)

    def f(x):
        ce, alpha, _ = soft_cross_entropy_acceptance(x, p, rows)
        return ce * w, -alpha.log()
    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-6)


def test_equal_distributions_accept_everything():
    torch.manual_seed(2)
    logits = torch.randn(5, 40) * 3
    p = torch.softmax(logits, -1)
    _, alpha, _ = soft_cross_entropy_acceptance(logits, p, torch.arange(5))
    assert torch.allclose(alpha, torch.ones(5), atol=1e-5)
    # through ttt_loss: one step, a head that reproduces the teacher's logits -> lk_alpha loss 0
    mask = torch.tensor([[False, True, True, True, True, True]])
    teach = {"target_p": p, "row": torch.tensor([[-1, 0, 1, 2, 3, 4]]),
             "target_arg": torch.tensor([[-1, *p.argmax(-1).tolist()]]), "in_vocab": mask.clone()}
    hidden = [torch.zeros(1, 6, 40)]
    hidden[0][0, :5] = logits
    total, stats = ttt_loss(hidden, lambda x: x, teach, mask, torch.tensor([5.0]), objective="lk_alpha")
    assert abs(float(total)) < 1e-5 and int(stats["correct"][0]) == 5


def random_teacher(b, t, dv, seed):
    """A teacher dict as teacher_targets / teacher_from_topk give it: some supervised positions not
    draftable (in_vocab False), some top-k rows, one row of zeros (a top-k row with no draftable entry)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.25
    m = int(mask.sum())
    p = torch.softmax(torch.randn(m, dv, generator=g) * 3, -1)
    p[1::3] = topk_like(p[1::3], 4)
    row = torch.full((b, t), -1, dtype=torch.int64)
    row[mask] = torch.arange(m)
    arg = torch.full((b, t), -1, dtype=torch.int64)
    arg[mask] = p.argmax(-1)
    oov = mask & (torch.rand(b, t, generator=g) < 0.2)
    arg[oov] = -1
    first_oov = oov.nonzero()[0]
    p[row[tuple(first_oov)]] = 0.0                                # nothing draftable: zero row, not in vocab
    return {"target_p": p, "row": row, "target_arg": arg, "in_vocab": arg >= 0}, mask


@pytest.mark.parametrize("objective", ["kl", "lk_alpha", "lk_lambda"])
def test_ttt_loss_equals_position_by_position_float64(objective, small_chunks):
    torch.manual_seed(3)
    b, t, k_steps, hd, dv = 3, 9, 3, 6, 40
    teach, mask = random_teacher(b, t, dv, seed=4)
    assert not bool(teach["in_vocab"].all()) and bool((teach["target_p"].sum(-1) == 0).any())
    hidden = [torch.randn(b, t, hd, requires_grad=True) for _ in range(k_steps)]
    w_head = (torch.randn(dv, hd) * 0.7).requires_grad_()
    den = step_counts(teach, k_steps).clamp(min=1).float()
    total, stats = ttt_loss(hidden, lambda x: x @ w_head.T, teach, mask, den, objective=objective)
    want = torch.zeros((), dtype=torch.float64)
    for k in range(k_steps):
        logits = hidden[k].double() @ w_head.double().T
        ces, alphas = [], []
        for bi in range(b):
            for pos in range(t - 1 - k):
                s = pos + 1 + k
                if not teach["in_vocab"][bi, s]:
                    continue
                p = teach["target_p"][teach["row"][bi, s]].double()
                ces.append(-(p * torch.log_softmax(logits[bi, pos], 0)).sum())
                alphas.append(torch.minimum(p, torch.softmax(logits[bi, pos], 0)).sum())
        ce, alpha = torch.stack(ces), torch.stack(alphas)
        if objective == "kl":
            step_loss = ce.sum()
        elif objective == "lk_alpha":
            step_loss = -alpha.log().sum()
        else:
            lam = torch.exp(-LK_ETA * alpha.detach().mean())
            step_loss = lam * ce.sum() + (1 - lam) * (1 - alpha).sum()
        want = want + 0.8 ** k * step_loss / len(ces)
        assert abs(float(stats["loss_sum"][k]) - float(ce.detach().sum())) < 1e-4        # stats: the soft-CE, always
        assert int(stats["num_loss"][k]) == len(ces)
    assert torch.isfinite(total) and abs(float(total.detach()) - float(want.detach())) < 1e-5
    got = torch.autograd.grad(total, [*hidden, w_head])
    ref = torch.autograd.grad(want, [*hidden, w_head])
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all() and torch.allclose(g.double(), r.double(), atol=1e-5)


def test_kl_path_unchanged():
    """objective="kl" is today's ttt_loss: the default, bit for bit, and the soft-CE sum it always was."""
    torch.manual_seed(5)
    b, t, k_steps, hd, dv = 2, 8, 3, 6, 40
    teach, mask = random_teacher(b, t, dv, seed=6)
    hidden = [torch.randn(b, t, hd, requires_grad=True) for _ in range(k_steps)]
    w_head = torch.randn(dv, hd, requires_grad=True)
    den = step_counts(teach, k_steps).clamp(min=1).float()
    head = lambda x: x @ w_head.T  # noqa: E731
    a_total, a_stats = ttt_loss(hidden, head, teach, mask, den)
    b_total, b_stats = ttt_loss(hidden, head, teach, mask, den, objective="kl")
    assert torch.equal(a_total, b_total) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                                                 for key in a_stats for x, y in zip(a_stats[key], b_stats[key]))
    want = 0.0
    for k in range(k_steps):
        bi, ti = mask[:, 1 + k:].nonzero(as_tuple=True)
        label = (bi, ti + 1 + k)
        ce, _ = soft_cross_entropy(head(hidden[k][bi, ti]), teach["target_p"], teach["row"][label])
        want = want + 0.8 ** k * (ce * teach["in_vocab"][label]).sum() / den[k]
    assert torch.equal(a_total, want)
    for g, h in zip(torch.autograd.grad(a_total, [*hidden, w_head]), torch.autograd.grad(want, [*hidden, w_head])):
        assert torch.equal(g, h)
    with pytest.raises(ValueError, match="objective"):
        ttt_loss(hidden, head, teach, mask, den, objective="tv")


def test_run_batch_passes_the_loss_flag():
    from common.training.distributed import Ranks
    model, batch, lm_head = micro_batch()
    out = {}
    for objective in ("kl", "lk_alpha", "lk_lambda"):
        args = SimpleNamespace(ttt_steps=3, loss_normalization="supervised", loss=objective)
        out[objective] = train.run_batch(model, lm_head, batch, args, Ranks(), contextlib.nullcontext)
    assert train.build_parser().parse_args([]).loss == "kl"
    kl, lk = out["kl"], out["lk_alpha"]
    for key in ("loss_sum", "num_loss", "correct"):          # same rows, same soft-CE stats
        assert all(abs(float(x) - float(y)) < 1e-5 for x, y in zip(kl[1][key], lk[1][key]))
    kl_loss, lk_loss, lam_loss = (float(out[o][0].detach()) for o in ("kl", "lk_alpha", "lk_lambda"))
    assert abs(kl_loss - lk_loss) > 1e-3 and abs(lk_loss - lam_loss) > 1e-3 and lk_loss > 0


RANK_SAMPLES = ([0, 1], [2])   # micro_batch's 3 samples over 2 ranks: their mean acceptances differ


def lk_lambda_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of test_lk_lambda_objective_does_not_depend_on_world_size: its samples of micro_batch through
    04's run_batch in a gloo group; saves its loss and gradients."""
    import torch.distributed as dist

    from common.training.distributed import Ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, batch, lm_head = micro_batch()
        part = RANK_SAMPLES[rank]
        mine = {k: (v[part] if torch.is_tensor(v) else len(part)) for k, v in batch.items()}
        args = SimpleNamespace(ttt_steps=3, loss_normalization="supervised", loss="lk_lambda")
        loss, _ = train.run_batch(model, lm_head, mine, args, Ranks(rank=rank, world=world), contextlib.nullcontext)
        loss.backward()
        torch.save({"loss": loss.detach(), "grads": [p.grad for p in model.parameters() if p.requires_grad]},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_lk_lambda_objective_does_not_depend_on_world_size(tmp_path):
    """lk_lambda's lam comes from the global batch's mean acceptance (all ranks' rows, as SpecForge's
    reduce_fn), so two gloo ranks holding parts of a batch train the objective one process trains on all
    of it: the DDP-averaged gradient and the summed loss are one process's. A per-rank mean gives each rank
    its own lam, and the sum is another objective."""
    import torch.multiprocessing as mp

    from common.training.distributed import Ranks
    world = len(RANK_SAMPLES)
    mp.spawn(lk_lambda_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model, batch, lm_head = micro_batch()
    args = SimpleNamespace(ttt_steps=3, loss_normalization="supervised", loss="lk_lambda")
    loss, _ = train.run_batch(model, lm_head, batch, args, Ranks(), contextlib.nullcontext)
    loss.backward()
    assert abs(sum(float(p["loss"]) for p in parts) / world - float(loss.detach())) < 1e-6 * abs(float(loss.detach()))
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    for i, g in enumerate(grads):      # DDP: the mean over ranks of each rank's gradient of loss * world
        ddp = sum(p["grads"][i] for p in parts) / world
        assert torch.allclose(ddp, g, rtol=1e-5, atol=1e-7), (i, float((ddp - g).abs().max()))


@pytest.mark.parametrize("objective", ["lk_alpha", "lk_lambda"])
def test_train_end_to_end_with_lk_loss(upstream, tmp_path, micro_target, objective):
    work = fresh_work(upstream, tmp_path)
    train.main(["--work-dir", str(work), *FLAGS, "--num-epochs", "4", "--eval-every", "1000",
                "--save-every", "1000", "--target-path", str(micro_target), "--loss", objective])
    out = stage_dir(work, TRAIN)
    man = json.loads((out / "manifest.json").read_text())
    assert man["config"]["loss"] == objective
    tr = [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert tr[-1]["loss"][0] < 0.85 * tr[0]["loss"][0]                  # the soft-CE falls under LK too
    assert tr[-1]["acc"][0] > tr[0]["acc"][0] + 0.1 and man["final_eval"]["acc"][0] > 0.05
