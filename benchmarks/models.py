"""Built-in workloads: a small decoder-only GPT with named size presets, and a plain MLP.

Both take byte tokens ``idx`` of shape (batch, seq) and next-byte ``targets`` of the same shape
and return the mean cross-entropy loss, so every benchmark mode drives them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BYTE_VOCAB = 256
"""Byte-level tokens: no tokenizer to download and every text is representable."""

INIT_STD = 0.02
"""GPT-2's init scale; keeps the first loss near ln(256) so a falling loss is easy to read."""


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of a GPT; ``seq_len`` is also the longest context the position table holds."""

    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    vocab_size: int = BYTE_VOCAB

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, GPTConfig] = {
    # Seconds for a whole test file on a laptop.
    "tiny": GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2),
    # ~3.2M params: one step of 8x128 tokens per rank takes ~0.2-1 s on one CPU core per rank.
    "default": GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=4),
    # ~25M params: a few seconds per CPU step; small for one GPU.
    "small": GPTConfig(seq_len=256, d_model=512, n_layers=8, n_heads=8),
    # ~200M params: GPU only.
    "medium": GPTConfig(seq_len=512, d_model=1024, n_layers=16, n_heads=16),
    # ~770M params: big enough that communication matters on a multi-GPU node.
    "large": GPTConfig(seq_len=1024, d_model=1536, n_layers=24, n_heads=16),
}


@dataclass(frozen=True, slots=True)
class MLPConfig:
    """A next-byte predictor from the current byte alone: an embedding and a GELU MLP."""

    d_model: int = 256
    hidden: int = 1024
    n_layers: int = 4
    vocab_size: int = BYTE_VOCAB


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through the fused SDPA kernel (no explicit mask tensor)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    """Pre-LN transformer block: the residual stream is never normalized, which trains stably
    without warm-up at the short runs a benchmark does."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.mlp_ratio * config.d_model),
            nn.GELU(),
            nn.Linear(config.mlp_ratio * config.d_model, config.d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only GPT: token + learned position embeddings, pre-LN blocks, final LayerNorm and a
    head tied to the token embedding (one weight used twice, which exercises the wrapper's
    handling of a param whose grad is accumulated from two places)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(_init_weights)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MLP(nn.Module):
    """A plain MLP over one byte's embedding: no attention, so it isolates dense matmuls and
    gives many equally sized params to the layout code."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        layers: list[nn.Module] = [nn.Linear(config.d_model, config.hidden), nn.GELU()]
        for _ in range(config.n_layers - 2):
            layers += [nn.Linear(config.hidden, config.hidden), nn.GELU()]
        layers.append(nn.Linear(config.hidden, config.vocab_size))
        self.net = nn.Sequential(*layers)
        self.apply(_init_weights)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self.net(self.emb(idx))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


MODEL_NAMES = (*PRESETS, "mlp")


def hidden_matrix_names(model: nn.Module) -> set[str]:
    """Names of the params Muon users give Muon: the hidden layers' weight matrices (the GPT's
    block matrices, the MLP's layers but its head). Embeddings, norms, biases and the head go to
    AdamW (docs/muon-adafactor.md)."""
    if isinstance(model, GPT):
        return {name for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")}
    if isinstance(model, MLP):
        head = f"net.{len(model.net) - 1}."
        return {
            name
            for name, p in model.named_parameters()
            if p.ndim == 2 and name.startswith("net.") and not name.startswith(head)
        }
    raise ValueError(f"hidden_matrix_names expects a GPT or an MLP but got {type(model).__name__}")


def build_model(name: str, seed: int) -> nn.Module:
    """Build preset ``name`` (a GPT preset or ``"mlp"``) with weights from ``seed`` only.

    The global RNG is forked, so building a model neither depends on nor disturbs the caller's
    random state: every benchmark mode gets bitwise identical initial weights.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"build_model expects one of {', '.join(MODEL_NAMES)} but got {name!r}")
    if name != "mlp":
        return build_gpt(PRESETS[name], seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(MLPConfig())


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    """A GPT of any shape with weights from ``seed`` only, the caller's random state untouched
    (as :func:`build_model`), for benchmarks that size their own model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def model_seq_len(name: str, requested: int | None) -> int:
    """The sequence length to train ``name`` at: ``requested`` if given, else the preset's."""
    if requested is not None:
        return requested
    return PRESETS[name].seq_len if name in PRESETS else PRESETS["default"].seq_len
