"""Small models of every structured spec form (concatenation, flatten, grouped convolution, attention
heads, recurrent layer), shared by the tests that run each method on each form."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pyperm.nn import trace_model
from pyperm.nn.spec import Blocks, Interleaved, Segments, Tiled, entry_groups


class DenseBlock(nn.Module):
    """Concatenation: every layer reads the concatenated outputs of the ones before it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.convs = nn.ModuleList([nn.Conv2d(6, 4, 3, padding=1), nn.Conv2d(10, 4, 3, padding=1)])
        self.fc = nn.Linear(14, 3)

    def forward(self, x):
        h = self.stem(x)
        for conv in self.convs:
            h = torch.cat([h, F.relu(conv(F.relu(h)))], 1)
        return self.fc(h.mean((2, 3)))


class FlattenHead(nn.Module):
    """Flatten of a 6 x 3 x 3 feature map into a Linear: each channel owns 9 consecutive inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(54, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


class GroupedConv(nn.Module):
    """A 1x1 convolution, a grouped 3x3 one (2 groups of 4 channels) and a 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))).mean((2, 3)))


class Attention(nn.Module):
    """A residual nn.MultiheadAttention block (4 heads of 3 dimensions) between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.attn = nn.MultiheadAttention(12, 4, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class Recurrent(nn.Module):
    """A GRU (its hidden-to-hidden weights carry the hidden group on both axes) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.rnn = nn.GRU(6, 10, batch_first=True)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.rnn(torch.tanh(self.inp(x)))[0][:, -1])


class ChannelShuffle(nn.Module):
    """Two ShuffleNet units: branches concatenated and shuffled (their halves interleaved), then a chunk that
    passes one half on and feeds the other to a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 1)
        self.a, self.b = nn.Conv2d(6, 6, 1), nn.Conv2d(6, 6, 1)
        self.norm = nn.GroupNorm(1, 6)
        self.c = nn.Conv2d(6, 6, 1)
        self.fc = nn.Linear(12, 3)

    @staticmethod
    def shuffle(x):
        b, c, h, w = x.shape
        return x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = self.shuffle(torch.cat([F.relu(self.a(h)), F.relu(self.b(h))], 1))
        left, right = h.chunk(2, dim=1)
        h = self.shuffle(torch.cat([left, F.relu(self.c(self.norm(right)))], 1))
        return self.fc(h.mean((2, 3)))


# name: (model, example input shape, the form the structured spec must hold)
STRUCTURED = {
    "concatenation": (DenseBlock, (2, 3, 5, 5), Segments),
    "flatten": (FlattenHead, (2, 3, 3, 3), Tiled),
    "grouped-convolution": (GroupedConv, (2, 3, 5, 5), Blocks),
    "attention-heads": (Attention, (2, 6, 5), Blocks),
    "recurrent": (Recurrent, (2, 5, 4), "two axes"),
    "channel-shuffle": (ChannelShuffle, (2, 3, 5, 5), Interleaved),
}


def structured_model(name: str, seed: int):
    """A model of ``STRUCTURED`` (float64, weights spread so that no two units tie), its traced structured
    spec and an input."""
    factory, shape, form = STRUCTURED[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = factory().double().eval()
        x = torch.randn(*shape, dtype=torch.float64)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    spec = trace_model(model, x, composite="raise", structured=True).spec
    entries = [e for axes in spec.axes.values() for e in axes]
    if form == "two axes":  # a group on two axes of one tensor (the recurrent weight, P W P^T)
        named = [[g for e in axes for g in entry_groups(e)] for axes in spec.axes.values()]
        assert any(len(groups) > len(set(groups)) for groups in named)
    else:
        assert any(isinstance(e, form) or (isinstance(e, Segments) and any(isinstance(p, form) for p in e.parts))
                   for e in entries)  # fmt: skip
    return model, spec, x


def outputs(model: nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    """``model``'s output on ``x`` with ``state`` loaded into a copy."""
    other = copy.deepcopy(model)
    other.load_state_dict(state)
    with torch.no_grad():
        return other(x)
