"""What each stage of an ask served, as its own receipts sign it: the asker countersigns these.

At the end of each epoch the audit holds every stage's receipts by position; the last one of a
stage chains (``h_hist``) every input the session brought it and says how many positions it ran,
so it is the head of the stage's own account of the work. A stage the ask caught lying served
nothing worth credit; a range a replica checked to the end of the answer is marked so.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from meshd.client.ask import AskResult
from meshd.client.audit import Audit
from wire.credit import WorkSummary
from wire.identity import NodeIdentity
from wire.receipt import Receipt


@dataclass(frozen=True)
class Served:
    """One stage's work in one epoch of an ask, before the asker signs it."""

    model: str
    layer_begin: int
    layer_end: int
    prompt_tokens: int
    generated_tokens: int
    checked: bool
    head: Receipt

    @property
    def stage(self) -> str:
        return self.head.node_id

    def signed(self, identity: NodeIdentity, at: int) -> WorkSummary:
        return WorkSummary.create(identity, self.model, self.layer_begin, self.layer_end, self.prompt_tokens,
                                  self.generated_tokens, self.checked, at, self.head)


def served_work(audit: Audit, result: AskResult, liars: Collection[str]) -> list[Served]:
    """Each stage's last receipt of `audit`'s epoch with the work it signs, but the liars'."""
    prompt_len = audit.prompt_len
    if prompt_len is None or not audit.model:
        return []
    unchecked = {(n.layer_begin, n.layer_end, n.node_id) for n in result.unverified}
    out = []
    for index, signed in enumerate(audit.by_stage):
        node_id = audit.node_ids[index]
        if not signed or node_id in liars:
            continue
        head = signed[max(signed)]
        if head.node_id != node_id:
            continue
        end = head.pos + head.n_tokens
        prompt = min(prompt_len, end)
        checked = bool(result.checked) and (head.layer_begin, head.layer_end, node_id) not in unchecked
        out.append(Served(audit.model, head.layer_begin, head.layer_end, prompt, end - prompt, checked, head))
    return out
