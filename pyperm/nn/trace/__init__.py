"""Building a :class:`~pyperm.nn.PermutationSpec` by tracing a model with :mod:`torch.fx` or :mod:`torch.export`.

How it works
------------
The model is traced symbolically (``torch.fx``; the standard ``torch.nn`` layers and
module types with a registered rule stay leaves) and the graph is then run once on the
example input by an interpreter (:mod:`~pyperm.nn.trace.interpreter`) that labels every
tensor it computes: for each axis of the tensor, the *unit class* acting on that axis,
or ``None`` when the axis is invariant (not permuted).

Where torch.fx cannot trace the model (Python control flow that reads shapes or values: Hugging
Face transformers), it is exported by ``torch.export.export(model, args, strict=False)`` on the
example input instead (:mod:`~pyperm.nn.trace.export`): a graph of ATen operators reading the
model's own parameters under their ``state_dict`` names. ATen operators get the rule of their
Python counterpart (``aten.linear`` that of ``F.linear``, ``aten.view`` that of ``Tensor.view``),
or one of :mod:`~pyperm.nn.trace.rules.aten` where their arguments or meaning differ (``addmm``
for GPT-2's ``Conv1D``, ``embedding``, ``slice``, ``expand``); modules whose rule the exported
operators cannot replace (``nn.MultiheadAttention``, recurrent layers, module types registered
outside torch) are kept whole as ``call_module`` nodes. ``TraceResult.frontend`` says which built
the graph; ``trace_model(..., frontend="export")`` asks for one. When neither can trace the model,
:class:`TraceError` gives both reasons.

Unit classes live in a union-find over *atoms* (:mod:`~pyperm.nn.trace.labels`); an atom
is one axis of one ``state_dict`` tensor. A parameter read by the graph is labelled with
its own atoms, so ``Linear`` turns an input labelled ``(.., a)`` into an output labelled
``(.., W0)`` and joins ``a`` with ``W1`` (the weight's input axis); BatchNorm, LayerNorm,
biases, elementwise products with parameters and residual additions join classes the
same way. A join with an invariant axis (the model input, a constant, a buffer outside
the ``state_dict``) *fixes* the class: it is never permuted. The model's outputs fix
every class they carry, so a model's inputs and outputs are never permuted.

Each operation is labelled by a *rule* registered for its module type, function or
Tensor method (:mod:`~pyperm.nn.trace.rules`, one module per operation family; users add
rules with :func:`register_trace_rule`). After the run, every class that reaches an
activation and is not fixed becomes one permutation group.

Composite axes
--------------
:class:`~pyperm.nn.PermutationSpec` names one group per axis. Some operations build a
channel axis out of several groups or out of parts of one: ``torch.cat`` along channels,
``F.pad`` or slicing along channels (ResNet "option A" shortcuts), and ``flatten`` of a
convolution output whose spatial extent is larger than 1x1 (the next Linear's input then
holds blocks of ``H*W`` features per channel). A spec cannot name such an axis, nor a group
that would act on two axes of one tensor (a layer applied to its own output, or weights
tied across layers: ``P W P^T``), nor the units inside a module without a rule. Every
group that enters such an axis is fixed, which keeps the spec exact (the permuted model
computes the same function) at the price of leaving those units unaligned, and each cause
is listed in ``TraceResult.composites`` with its module path. By default
(``composite=None``) a :class:`TraceWarning` says so; ``composite="fix"`` accepts it
silently and ``composite="raise"`` raises :class:`TraceError` at the first cause. A
flatten whose spatial extent is 1 (global pooling, then flatten: the common case) is not
composite: the features are the channels.

With ``structured=True`` (:func:`trace_model`, :meth:`PermutationSpec.from_model`) the
tracer names these axes instead of fixing their units, with the spec's axis forms
(:mod:`pyperm.nn.spec`): a concatenation along units is a ``Segments`` axis, a flatten of
a ``C x H x W`` feature map a ``Tiled`` one, a split of an axis of units in two (heads x
head_dim, a channel shuffle's halves) a group moving the blocks and a group moving the
units within every block alike (``Tiled`` with a group as ``outer``), a split in more
(q/k/v x heads x head_dim of a fused projection) a new group tiled over the outer axes,
``chunk``/``split`` along units a cut of every class it goes through into one class per
piece (the class's axes become ``Segments`` of the pieces' groups, wherever it acts), a
layer applied to its own output names its group on both axes of its weight, a one-layer
``nn.RNN``/``nn.GRU``/``nn.LSTM`` has its hidden units as a group with the gates as
segments, ``nn.MultiheadAttention`` its heads and the units within each head as
``Blocks`` axes (each head its own permutation), and a grouped convolution its channel
groups as a group moving whole blocks: its output channels are ``Blocks`` (each group
its own permutation within), its input channels a ``Tiled`` group whose copies that
group moves (one permutation within every group, since every filter of a group reads
its input channels in one order; where another structure keeps the groups in place,
``Blocks`` with a number of blocks). After a reshape the head dims get one permutation
shared by every head: a reshape labels each axis on its own, so the tracer cannot carry
one permutation per head (a hand-written spec can, with ``Blocks``).

Attention variants: with grouped-query attention (key/value heads repeated over the query
heads they serve, by ``expand`` + ``reshape`` or SDPA's ``enable_gqa``) the key/value heads
are a group that moves every key/value head with its block of query heads, and the query
heads within every block move alike by a group of their own (``Tiled(within, kv, head_dim)``
on the query projection's rows); the head dims move by the key's and value's head-dim groups,
alike in every query head: the query projection's rows and the output projection's columns
are copies of a tiled unit, ``Tiled(Tiled(dims, outer=within), outer=kv)``. Multi-query
attention (one key/value head) leaves the query heads free. (The query heads within a block need the key/value heads'
``expand`` to give the axes it creates a class, which the ATen rule of ``expand`` does and the
torch.fx rule does not yet: under torch.fx they stay in order, and so do multi-query attention's
query heads when ``repeat_kv`` expands the single key/value head.) Rotary position embeddings turn every pair of query/key head
dims at its own frequency, so no permutation of those dims keeps the function: multiplying by
the cos/sin tables fixes them (value head dims stay permuted); with partial rotary embeddings
(Phi: only the first dims of every head turn) every query/key head is a fixed part and a group,
``Tiled(Segments(rotary, dims), outer=heads)``. A fused q/k/v projection is
``Segments`` of q, k and v; GPT-2's ``Conv1D`` (``addmm`` with the weight stored (in, out)),
RMSNorm written out (pow, mean, rsqrt, mul), gated MLPs (gate and up projections share the
intermediate group) and tied input and output embeddings (one tensor, one group) need nothing
special: the residual stream comes out as one group through every block, norms included.

ShuffleNet's channel shuffle splits a concatenation ``cat(a, b)`` into its two halves,
transposes and merges them back: channel ``2 i + j`` is unit ``i`` of half ``j``, an
``Interleaved(a, b)`` axis in which each half keeps its own permutation. The next block's
``chunk(2)`` takes the first half of the channels, the first half of the units of both
``a`` and ``b``: it cuts both classes in two (their axes become ``Segments`` of the pieces),
and the passed-on half is an interleave of interleaves after a few blocks. Only pieces of a
single unit (no order to change) stay as they are. A concatenation not split into its own
equal parts (or a plain axis split in two) still ties what the split mixes: the blocks
stay in place and the units within them move alike.

Operations that cannot be handled at all (a reshape that splits a channel axis, an
order-dependent operation such as ``sort``/``cumsum``/``flip`` along channels, an unknown
function or module applied to permuted channels, a grouped convolution) raise
:class:`TraceError` naming the operation, the graph node and the module path. Unknown
operations applied only to invariant tensors are accepted: their results are invariant.

Activation sites
----------------
See :mod:`~pyperm.nn.trace.sites`: where each group's units appear before and after the
nonlinearity, which :func:`pyperm.nn.activation_matching` hooks.
"""

from pyperm.nn.trace import rules
from pyperm.nn.trace.call import TraceCall
from pyperm.nn.trace.errors import TraceError
from pyperm.nn.trace.labels import Label
from pyperm.nn.trace.registry import register_trace_rule
from pyperm.nn.trace.sites import ActivationSite, Projection, Role
from pyperm.nn.trace.tracer import TraceResult, TraceWarning, symbolic_trace, trace_model

__all__ = [
    "ActivationSite",
    "Label",
    "Projection",
    "Role",
    "TraceCall",
    "TraceError",
    "TraceResult",
    "TraceWarning",
    "register_trace_rule",
    "rules",
    "symbolic_trace",
    "trace_model",
]
