"""04's warm start: an imported draft (common/draft/imported.py) as the init, and the L2-SP pull toward it.

The draft's shape and form (attention, MLA dims, heads, MLP, head_dim, RoPE and YaRN, eps, fc_norm,
norm_output) is the imported one's; the export writes it back as read, with the imported draft's model
type and the config keys both engines ignore (WarmStart.export_config), in the imported dtype. Its
vocabulary is either kept as imported (`keep`: its d2t/t2d, the lm_head untouched, so zero steps export the same draft) or mapped
onto 03's draft vocab by target token id (`map`): row j of the new lm_head is the imported row of the
same target token; a token the imported draft lacks starts as the MEAN of the imported rows (its logit
is the average logit, below any row the draft already prefers, and it moves like the others), and the
coverage of 03's vocab is reported (rows, and the share of 03's token counts when 03 stored them).

L2-SP (Li et al. 2018, "Explicit inductive bias for transfer learning"): loss += weight * sum over the
trainable tensors of ||w - w0||^2, w0 the weights right after the init. It pulls the fine-tune toward the
imported draft, to keep what it knew of other traffic (forgetting) while it learns the user's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from common.draft.imported import ImportedDraft, build_model, export_config
from common.draft.model import Eagle3DraftModel

VOCAB_MODES = ("keep", "map")


@dataclass
class WarmStart:
    draft: ImportedDraft
    vocab: str            # keep | map
    coverage: dict        # how much of the final draft vocab the imported lm_head covered

    def identity(self) -> dict:
        return {**self.draft.identity(), "vocab": self.vocab, "coverage": self.coverage}

    def export_config(self) -> dict:
        """The imported draft's fields the export writes back besides our config (imported.export_config)."""
        return export_config(self.draft)


def map_lm_head(d: ImportedDraft, d2t: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The imported lm_head's rows moved onto the draft vocab `d2t` (target id = draft id + d2t), by target
    id; rows the imported draft lacks = the mean imported row. counts: 03's per-draft-token counts, if any.
    Returns (weight [len(d2t), H] float32, coverage)."""
    w = d.state["lm_head.weight"].float()                               # [Dv_imp, H]
    src_targets = torch.arange(len(d.state["d2t"])) + d.state["d2t"]   # imported row -> target id
    row_of = torch.full((d.config["vocab_size"],), -1, dtype=torch.int64)
    row_of[src_targets] = torch.arange(len(src_targets))
    src = row_of[torch.arange(len(d2t)) + d2t]                         # our row -> imported row or -1
    found = src >= 0
    out = w.mean(0, keepdim=True).repeat(len(d2t), 1)
    out[found] = w[src[found]]
    coverage = {"rows": len(d2t), "rows_found": int(found.sum()), "row_share": float(found.float().mean()),
                "missing_rows_init": "mean of the imported lm_head rows"}
    if counts is not None:
        coverage["count_share"] = float(counts[found].sum() / counts.sum().clamp(min=1))
    return out, coverage


def warm_start_model(d: ImportedDraft, vocab: str, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                     counts: torch.Tensor | None = None) -> tuple[Eagle3DraftModel, WarmStart]:
    """The draft initialised from `d` (float32, with the target's embedding `embed`); with `map`, on the
    draft vocab d2t/t2d (03's)."""
    if vocab == "map":
        lm_head, coverage = map_lm_head(d, d2t, counts)
        # the same draft on 03's vocab: only the head rows and the mapping change
        mapped = replace(d, config={**d.config, "draft_vocab_size": len(d2t)},
                         state={**d.state, "lm_head.weight": lm_head, "d2t": d2t.to(torch.int64),
                                "t2d": t2d.to(torch.bool)})
    else:
        assert vocab == "keep", vocab
        mapped = d
        coverage = {"rows": d.config["draft_vocab_size"], "rows_found": d.config["draft_vocab_size"], "row_share": 1.0}
    model = build_model(mapped, embed).train()
    return model, WarmStart(d, vocab, coverage)


def anchors(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Detached copies of the trainable weights right after the init (w0 of L2-SP)."""
    return [p.detach().clone() for p in params]


def l2sp_penalty(params: list[torch.nn.Parameter], anchor: list[torch.Tensor]) -> torch.Tensor:
    """sum_i ||w_i - w0_i||^2 (float32); its gradient is 2 (w - w0)."""
    return sum(((p.float() - a.float()) ** 2).sum() for p, a in zip(params, anchor))
