"""Mode-connecting curves between trained models, on any PyTorch model.

- :class:`BezierCurve`, :class:`PolyChain`: curves whose bends are the only trainable
  parameters, run through :func:`torch.func.functional_call` on the user's model.
- :func:`train_curve`: Algorithm 2 of Tatro et al. (Garipov et al.'s curve finding), also
  under torch.distributed data parallelism; :class:`CurveTrainer` is its single step, for
  methods that interleave curve steps with other work.
- :func:`evaluate_curve` and :class:`CurveResult`: loss and accuracy along the curve, with
  BatchNorm statistics recomputed at every point.
- :func:`connect`: align B to A, train the curve, evaluate it.
- :func:`loss_plane`, :func:`correlation_signature`: the planes and correlation
  signatures of Tatro et al.'s figures.
"""

from pyperm.nn.curves.bezier import BezierCurve
from pyperm.nn.curves.connect import ConnectResult, connect
from pyperm.nn.curves.evaluate import CurveResult, evaluate_curve, plot_curve_results, summary_table
from pyperm.nn.curves.plane import PlaneResult, loss_plane
from pyperm.nn.curves.polychain import PolyChain
from pyperm.nn.curves.signature import CorrelationSignature, correlation_signature
from pyperm.nn.curves.train import CurveTrainer, train_curve

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
    "loss_plane",
    "plot_curve_results",
    "summary_table",
    "train_curve",
]
