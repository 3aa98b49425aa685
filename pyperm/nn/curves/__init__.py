"""Mode-connecting curves between trained models, on any PyTorch model.

- :class:`BezierCurve`, :class:`PolyChain`: curves whose bends are the only trainable
  parameters, run through :func:`torch.func.functional_call` on the user's model.
- :func:`train_curve`: Algorithm 2 of Tatro et al. (2020), Garipov et al.'s (2018) curve
  finding, also under torch.distributed data parallelism; :class:`CurveTrainer` is its single step, for
  methods that interleave curve steps with other work.
- :func:`evaluate_curve` and :class:`CurveResult` (a :class:`~pyperm.nn.eval.path.PathResult`):
  loss and accuracy along the curve, with BatchNorm statistics recomputed at every point;
  :func:`~pyperm.nn.eval.path.plot_paths` and :func:`~pyperm.nn.eval.path.summary_table`
  draw and tabulate several curves.
- :func:`save_curve`, :func:`load_curve`: a curve's bends, kind and endpoints' fingerprints
  in a safetensors file and back; :func:`load_garipov_curve` reads a curve saved by
  Garipov et al.'s public code (``dnn-mode-connectivity``) given the base model.
- :func:`garipov_schedule`: Garipov et al.'s learning-rate schedule (``recipe="garipov"``
  of :func:`train_curve` trains the way their code does).
- :func:`connect`: align B to A, train the curve, evaluate it.
- :func:`loss_plane`, :func:`correlation_signature`: the planes and correlation
  signatures of Tatro et al.'s figures.

References
----------
.. [1] N. J. Tatro, P.-Y. Chen, P. Das, I. Melnyk, P. Sattigeri, R. Lai, "Optimizing Mode
   Connectivity via Neuron Alignment", NeurIPS 2020.
.. [2] T. Garipov, P. Izmailov, D. Podoprikhin, D. Vetrov, A. G. Wilson, "Loss Surfaces,
   Mode Connectivity, and Fast Ensembling of DNNs", NeurIPS 2018.
"""

from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.checkpoint import load_curve, save_curve
from pyperm.nn.curves.connect import ConnectResult, connect
from pyperm.nn.curves.evaluate import evaluate_curve
from pyperm.nn.curves.garipov import load_garipov_curve
from pyperm.nn.curves.plane import PlaneResult, loss_plane
from pyperm.nn.curves.polychain import PolyChain
from pyperm.nn.curves.schedules import garipov_schedule
from pyperm.nn.curves.signature import CorrelationSignature, correlation_signature
from pyperm.nn.curves.train import CurveTrainer, train_curve
from pyperm.nn.eval.path import CurveResult

__all__ = [
    "BezierCurve",
    "ConnectResult",
    "CorrelationSignature",
    "CurveResult",
    "CurveTrainer",
    "PlaneResult",
    "PolyChain",
    "connect",
    "correlation_signature",
    "evaluate_curve",
    "garipov_schedule",
    "load_curve",
    "load_garipov_curve",
    "loss_plane",
    "save_curve",
    "train_curve",
]
