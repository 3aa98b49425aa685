"""Bundled reference models, each with its hand-written :class:`~pyperm.nn.PermutationSpec`.

The models are the ones the papers pyperm implements experiment with: MLPs (Git Re-Basin's
MNIST experiments), VGG11/VGG16 with BatchNorm and ResNet20 for 32x32 CIFAR images, and
TinyTen (Kornblith et al. 2019, used by Tatro et al. 2020). Every class exposes
``permutation_spec()``, whose keys are exactly the model's ``state_dict`` keys as torch
names them, BatchNorm ``running_mean``/``running_var`` included and
``num_batches_tracked`` left untouched (its axes tuple is empty). A model's inputs and
outputs are never permuted.

Group names say what each group permutes: ``"hidden2"`` is the second hidden layer of an
MLP, ``"conv3"`` the output channels of the third convolution (and of the BatchNorm after
it), ``"stage2"`` the residual stream shared by every block of a ResNet stage, and
``"stage2.block1"`` the inner channels of one residual block.

:func:`create_model` builds any of them from a name (``"mlp:784,512,512,10"``,
``"resnet20:4"``, ``"vgg16"``): the one registry the command line, the benchmarks and the
reproductions share. :func:`register_model` adds a user's architecture to it by name.
"""

from pyperm.nn.models._registry import (
    create_model,
    input_shape,
    model_names,
    model_usage,
    parse_model_name,
    register_model,
)
from pyperm.nn.models.huggingface import single_output
from pyperm.nn.models.mlp import MLP
from pyperm.nn.models.resnet import ResNet20, ResNet32
from pyperm.nn.models.tinyten import TinyTen
from pyperm.nn.models.vgg import VGG, VGG11, VGG16

__all__ = [
    "MLP",
    "VGG",
    "VGG11",
    "VGG16",
    "ResNet20",
    "ResNet32",
    "TinyTen",
    "create_model",
    "input_shape",
    "model_names",
    "model_usage",
    "parse_model_name",
    "register_model",
    "single_output",
]
