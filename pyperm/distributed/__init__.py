"""pyperm across processes and machines, on torch.distributed (gloo on CPUs, NCCL on GPUs).

- :func:`weight_matching`: the pair's tensors split over the ranks (each rank holds a share of
  the keys); the same permutations as one process.
- :func:`merge_many`: Git Re-Basin's MergeMany with every model's tensors split over the ranks.
- :func:`c2m3_merge`: C2M3's cycle-consistent merge with every model's tensors split over the ranks.
- :func:`check_same`: refuse, at the start, ranks that run another pyperm or read other inputs.
- :func:`failure_guard`: a rank that fails ends every rank with an error naming it.

The data split over the ranks instead (both models on every rank) is the ``group=`` keyword of
the data methods of :mod:`pyperm.nn`: ``activation_matching``, ``repair``, ``reset_bn_stats``,
``barrier``, ``evaluate_curve``; they all-reduce their statistics and sums.

Nothing here starts processes: ``torchrun`` (or any launcher) does, and the caller initialises
the process group. Under ``torchrun`` the command line initialises it for ``align`` and ``merge``:
``torchrun --nproc-per-node N -m pyperm align A B --model hf --out OUT`` splits the checkpoints'
shards over the ranks and writes the files one process writes, except where a step is within
rounding of a tie (:mod:`pyperm.commands._over_ranks`, :mod:`pyperm.commands._merge_over_ranks`).
See the guide page "Across processes and machines".

Importing this package imports ``torch.distributed.nn.functional`` when no process group exists
yet (:func:`pyperm._comm.import_group_defaults`): import it before ``init_process_group``, so
that ``destroy_process_group`` can free the group even when a model is traced (``torch.export``)
inside it. Importing :mod:`pyperm.nn` alone does not.
"""

from pyperm import _comm
from pyperm._comm import Channel, RankFailedError, check_same
from pyperm.distributed._failure import failure_guard
from pyperm.distributed.weight import DistributedMatchingResult, merge_many, weight_matching
from pyperm.nn.align.c2m3_over_ranks import c2m3_merge

_comm.import_group_defaults()

__all__ = ["Channel", "DistributedMatchingResult", "RankFailedError", "c2m3_merge", "check_same", "failure_guard",
           "merge_many", "weight_matching"]
