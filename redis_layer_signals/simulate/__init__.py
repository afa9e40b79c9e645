"""``rls simulate``: a prefill/decode-disaggregated deployment in miniature.

Prefill instances x ranks run a simulated GPU that prefills requests in chunks and emits one
batched signal per layer per forward step; a registrar delivers each request's cache task after
a delay, so a share of them arrive after the request's first layer-0 signal; senders send each
layer's new blocks and finish the request. Every request is then checked: every layer of every
chunk sent exactly once, nothing sent for the wrong request, every slot released, no key left.
The same deployment runs on the pre-fix behaviour (``drop``) and FastDeploy's process-local
fix (``local``) to show what each loses. With ``--tp N`` (``simulate.tp``) each instance is a
tensor-parallel group of N ranks sharing FastDeploy's barriers, checked for agreement instead.
"""

from .config import Mode, SimConfig
from .report import Summary
from .runner import node_summary, run_registrar, simulate

__all__ = ["Mode", "SimConfig", "Summary", "node_summary", "run_registrar", "simulate"]
